"""LlamaIndex retriever for rag-spec: ``llama_index.retrievers.rag_spec.RagSpecRetriever``."""

from llama_index.retrievers.rag_spec.base import RagSpecRetriever, SpecRetriever

__all__ = ["RagSpecRetriever", "SpecRetriever"]
