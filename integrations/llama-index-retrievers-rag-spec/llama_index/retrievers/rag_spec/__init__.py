"""LlamaIndex retriever for rag-spec: ``llama_index.retrievers.rag_spec.SpecRetriever``."""

from llama_index.retrievers.rag_spec.base import SpecRetriever

__all__ = ["SpecRetriever"]
