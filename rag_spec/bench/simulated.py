"""Stand-ins for services a user's retriever talks to: a store behind a network delay, and a
client that returns hits without vectors. The RaLM bench and the tutorials measure speculative
retrieval against them; the tests use them too."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from rag_spec.retrieval.types import Hit, Retriever


class DelayedRetriever:
    """A retriever behind a simulated service: ``latency_ms`` of delay per (batched) call."""

    def __init__(self, retriever: Retriever, latency_ms: float) -> None:
        self.retriever = retriever
        self.latency = latency_ms / 1000

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        time.sleep(self.latency)
        return self.retriever.search(queries, k)

    def __getattr__(self, name: str) -> Any:  # score, embedder, passages, ... stay local
        return getattr(self.retriever, name)


class SearchOnly:
    """A retriever seen as a user's own client sees it: ``search`` alone, hits without vectors
    (speculation then embeds the cached passages' texts to score its guesses)."""

    def __init__(self, retriever: Retriever) -> None:
        self.retriever = retriever

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        return [[replace(h, vector=None) for h in hits]
                for hits in self.retriever.search(queries, k)]
