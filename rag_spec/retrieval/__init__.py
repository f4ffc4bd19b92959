"""Retrieval: knowledge bases (dense faiss, sparse BM25) behind one batched search interface."""

from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.knowledge_base import KnowledgeBase
from rag_spec.retrieval.types import Hit, Retriever

__all__ = ["Embedder", "Hit", "KnowledgeBase", "Retriever"]
