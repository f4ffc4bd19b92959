"""LlamaIndex embeddings for rag-spec: ``from llama_index.embeddings.rag_spec import
RagSpecEmbedding``."""

from llama_index.embeddings.rag_spec.base import RagSpecEmbedding

__all__ = ["RagSpecEmbedding"]
