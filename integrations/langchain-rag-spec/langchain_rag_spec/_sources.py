"""LangChain retrievers and vector stores seen as rag_spec Retrievers (queries in, Hits out)."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore

from rag_spec import Hit, Retriever, require_retriever, side_by_side, stable_id

log = logging.getLogger(__name__)


class LangChainSource:
    """Searches a LangChain retriever (``batch``) or vector store (relevance-scored searches).

    rag_spec tells passages apart by id: a document's id is a hash of its ``id`` or, failing
    that, of its text, so equal documents get equal ids with nothing remembered.
    ``Hit.score`` is higher-is-better: a vector store's relevance score in [0, 1] (or, for
    stores that define none, 1 / rank); retrievers return no scores (0.0).
    """

    def __init__(self, source: BaseRetriever | VectorStore) -> None:
        self.source = source
        self._sized = isinstance(source, VectorStore) or _accepts_k(source)
        self._warned = False

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        if isinstance(self.source, VectorStore):
            found = side_by_side(lambda q: self._store_search(q, k), queries)
        else:
            options = {"k": k} if self._sized else {}
            found = [[(d, 0.0) for d in docs[:k]]
                     for docs in self.source.batch(list(queries), **options)]
            self._warn_if_short(found, k)
        return [[_hit(doc, float(score)) for doc, score in pairs] for pairs in found]

    def _store_search(self, query: str, k: int) -> list[tuple[Document, float]]:
        store = self.source
        try:
            return store.similarity_search_with_relevance_scores(query, k=k)
        except NotImplementedError:  # no relevance function: rank order, higher is better
            return [(d, 1.0 / (rank + 1))
                    for rank, d in enumerate(store.similarity_search(query, k=k))]

    def _warn_if_short(self, found: list[list[tuple[Document, float]]], k: int) -> None:
        if self._sized or self._warned or all(len(pairs) >= k for pairs in found):
            return
        self._warned = True
        log.warning("%s returns its own number of documents (asked for %d): prefetching is "
                    "limited to it. Raise the retriever's k to let rag-spec prefetch more.",
                    type(self.source).__name__, k)


def _accepts_k(retriever: BaseRetriever) -> bool:
    """Whether ``retriever.invoke(query, k=...)`` reaches its search (LangChain passes extra
    arguments only to retrievers whose ``_get_relevant_documents`` takes them)."""
    parameters = inspect.signature(type(retriever)._get_relevant_documents).parameters
    return "k" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD
                                    for p in parameters.values())


def _hit(doc: Document, score: float) -> Hit:
    doc_id = stable_id(doc.id or doc.page_content)
    title = str(doc.metadata.get("title") or doc.metadata.get("source") or "")
    return Hit(doc_id=doc_id, score=score, title=title, text=doc.page_content)


def as_retriever(source: Any) -> Retriever:
    """A rag_spec Retriever for ``source`` (LangChain objects are translated)."""
    if isinstance(source, BaseRetriever | VectorStore):
        return LangChainSource(source)
    return require_retriever(source, "a rag_spec KnowledgeBase (local or Milvus), a LangChain "
                                     "retriever or vector store")
