"""LangChain classes for rag-spec: drop-in replacements for ``ChatHuggingFace``,
``HuggingFacePipeline`` and your retriever that give the same answers sooner.

Example:
    >>> from langchain_rag_spec import ChatLookahead, SpecRetriever   # doctest: +SKIP
    >>> llm, retriever = ChatLookahead(), SpecRetriever(k=3)          # doctest: +SKIP
"""

from langchain_rag_spec.chat_models import ChatLookahead
from langchain_rag_spec.embeddings import RagSpecEmbeddings
from langchain_rag_spec.llms import LookaheadLLM
from langchain_rag_spec.ralm import IterativeRaLM
from langchain_rag_spec.retrievers import RagSpecRetriever, SpecRetriever

__all__ = ["ChatLookahead", "IterativeRaLM", "LookaheadLLM", "RagSpecEmbeddings",
           "RagSpecRetriever", "SpecRetriever"]
