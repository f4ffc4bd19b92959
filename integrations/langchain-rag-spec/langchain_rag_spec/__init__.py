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
           "RagSpecRetriever", "SpecRetriever", "tools_first"]


def __getattr__(name: str) -> object:
    """``tools_first`` loads LangChain's agents (the ``agents`` extra) on first use only."""
    if name == "tools_first":
        try:
            from langchain_rag_spec.agents import tools_first
        except ImportError as err:
            msg = (f"tools_first needs LangChain's agents ({err}); install them with: "
                   f"pip install 'langchain-rag-spec[agents]'.")
            raise ImportError(msg) from err
        return tools_first
    msg = f"module 'langchain_rag_spec' has no attribute {name!r}"
    raise AttributeError(msg)
