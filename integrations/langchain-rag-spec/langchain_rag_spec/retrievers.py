"""LangChain retrievers over a rag_spec knowledge base (or your retriever) that batch searches:
``RagSpecRetriever``, and ``SpecRetriever``, the same retriever that also turns speculative
retrieval on in ``IterativeRaLM``, as ``rag_spec.SpecRetriever`` does in
``rag_spec.IterativeRaLM``."""

from __future__ import annotations

from typing import Any

from langchain_core.callbacks import (
    AsyncCallbackManagerForRetrieverRun,
    CallbackManagerForRetrieverRun,
)
from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from pydantic import PrivateAttr

from langchain_rag_spec._sources import as_retriever
from rag_spec import BatchingRetriever, Hit, KnowledgeBase


class RagSpecRetriever(BaseRetriever):
    """Top-``k`` passages as Documents; concurrent and ``batch`` calls share one search.

    Attributes:
        source: a rag_spec ``KnowledgeBase`` (or any rag_spec Retriever), a LangChain retriever
            or vector store; ``None`` opens the default knowledge base.
        kind: index of the default knowledge base: "flat", "hnsw", "ivf" or "bm25".
        k: passages per query (``invoke(query, k=2)`` overrides it per call).

    Examples:
        >>> RagSpecRetriever(k=2).invoke("join two paths")[0].metadata["title"]  # doctest: +SKIP
        'posixpath.join'
    """

    source: Any = None
    kind: str = "flat"
    k: int = 4
    _backend: BatchingRetriever | None = PrivateAttr(default=None)

    def backend(self) -> BatchingRetriever:
        """The rag_spec Retriever that answers (opened on first use)."""
        if self._backend is None:
            source = KnowledgeBase.load_default(self.kind) if self.source is None else self.source
            self._backend = BatchingRetriever(as_retriever(source))
        return self._backend

    def _get_relevant_documents(self, query: str, *, run_manager: CallbackManagerForRetrieverRun,
                                k: int | None = None) -> list[Document]:
        return [_document(hit) for hit in self.backend().search([query], k or self.k)[0]]

    async def _aget_relevant_documents(self, query: str, *,
                                       run_manager: AsyncCallbackManagerForRetrieverRun,
                                       k: int | None = None) -> list[Document]:
        hits = await self.backend().asearch([query], k or self.k)
        return [_document(hit) for hit in hits[0]]


class SpecRetriever(RagSpecRetriever):
    """A ``RagSpecRetriever`` that turns speculative retrieval on: swapped into
    ``IterativeRaLM``, retrievals are guessed from a per-request cache and verified in batches
    (the answer stays the plain loop's). In any other chain it retrieves as
    ``RagSpecRetriever`` does.

    Examples:
        >>> IterativeRaLM(llm=ChatLookahead(), retriever=SpecRetriever())  # doctest: +SKIP
    """


def _document(hit: Hit) -> Document:
    return Document(page_content=hit.text,
                    metadata={"title": hit.title, "doc_id": hit.doc_id, "score": hit.score})
