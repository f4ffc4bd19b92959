"""LangChain retrievers and vector stores seen as rag_spec Retrievers (queries in, Hits out)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore

from rag_spec.errors import RagSpecError
from rag_spec.retrieval.types import Hit, Retriever


class LangChainSource:
    """Searches a LangChain retriever (``batch``) or vector store (``similarity_search``).

    rag_spec tells passages apart by id; a LangChain document's id is its ``id`` or, failing
    that, its text, numbered in the order first seen.
    """

    def __init__(self, source: BaseRetriever | VectorStore) -> None:
        self.source = source
        self._ids: dict[str, int] = {}
        self._lock = threading.Lock()

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        if isinstance(self.source, VectorStore):
            found = [self.source.similarity_search_with_score(q, k=k) for q in queries]
        else:
            found = [[(d, 0.0) for d in docs[:k]] for docs in self.source.batch(list(queries))]
        return [[self._hit(doc, float(score)) for doc, score in pairs] for pairs in found]

    def _hit(self, doc: Document, score: float) -> Hit:
        key = doc.id or doc.page_content
        with self._lock:
            doc_id = self._ids.setdefault(key, len(self._ids))
        title = str(doc.metadata.get("title") or doc.metadata.get("source") or "")
        return Hit(doc_id=doc_id, score=score, title=title, text=doc.page_content)


def as_retriever(source: Any) -> Retriever:
    """A rag_spec Retriever for ``source`` (LangChain objects are translated)."""
    if isinstance(source, BaseRetriever | VectorStore):
        return LangChainSource(source)
    if isinstance(source, Retriever):
        return source
    msg = (f"SpecRetriever cannot search a {type(source).__name__}. Pass a rag_spec "
           "KnowledgeBase, a LangChain retriever or vector store, or nothing (the default "
           "knowledge base).")
    raise RagSpecError(msg)
