"""A Retriever that answers concurrent single searches with one batched knowledge-base call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rag_spec.coalesce import Coalescer
from rag_spec.retrieval.types import Hit, Retriever
from rag_spec.threads import run_in_io_thread


class BatchingRetriever:
    """Wraps ``retriever`` so that searches arriving together from many threads (a framework's
    ``batch``, a server's requests) become one ``search`` call: one faiss call for all queries.

    Args:
        retriever: any Retriever.
        wait_ms: how long the first search waits for others to join it.
    """

    def __init__(self, retriever: Retriever, *, wait_ms: float = 1.0) -> None:
        self.retriever = retriever
        self._batcher: Coalescer[str, list[Hit]] = Coalescer(self._run, wait_ms=wait_ms,
                                                             max_batch=64)

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        return self._batcher(list(queries), key=k)

    async def asearch(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        """``search`` for event loops: concurrent calls share a search, on rag-spec's I/O pool
        (a generation on the compute thread never holds a retrieval up)."""
        requests = self._batcher.submit(list(queries), key=k)
        return await run_in_io_thread(self._batcher.complete, requests)

    def _run(self, k: Any, queries: Sequence[str]) -> list[list[Hit]]:
        return self.retriever.search(list(queries), k)

    def __getattr__(self, name: str) -> Any:  # score, passages, ... of the wrapped retriever
        return getattr(self.retriever, name)
