"""Speculative retrieval (RaLMSpec): guess each retrieval from a small per-request cache, then
check a batch of guesses with one call to the real knowledge base.

The cache ranks its passages with the knowledge base's own metric, computed here (see
``scoring``: never a call to the store per guess), so whenever the knowledge base's top-k
passages are in the cache they are also the cache's top-k: a guess is wrong only when the right
passage had not been seen yet. Verification calls fetch ``prefetch`` passages per query and
keep them all, which makes later guesses right more often.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from rag_spec.errors import RagSpecError
from rag_spec.retrieval.scoring import GuessScorer, scorer_for
from rag_spec.retrieval.types import Hit, Retriever


class SpecRetriever:
    """A Retriever that also opens speculation sessions; ``search`` passes straight through.

    Args:
        retriever: the knowledge base, local or remote (Milvus), or any Retriever.
        prefetch: passages kept per verified query (1 turns prefetching off).
        capacity: most passages a request's cache holds (least recently used leave first).
        scorer: how guesses rank cached passages; by default the retriever's own local
            ``score`` where it has one, else embeddings made here (``scoring.scorer_for``).
    """

    def __init__(self, retriever: Retriever, *, prefetch: int = 20, capacity: int = 256,
                 scorer: GuessScorer | None = None) -> None:
        if prefetch < 1 or capacity < 1:
            msg = "prefetch and capacity must be at least 1."
            raise RagSpecError(msg)
        self.retriever = retriever
        self.prefetch = prefetch
        self.capacity = capacity
        self.scorer = scorer or scorer_for(retriever)

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        return self.retriever.search(queries, k)

    def session(self) -> SpecSession:
        """A fresh cache for one request."""
        return SpecSession(self)


class SpecSession:
    """One request's cache: ``guess`` from it, ``verify`` against the knowledge base."""

    def __init__(self, owner: SpecRetriever) -> None:
        self.owner = owner
        self.cache: OrderedDict[int, Hit] = OrderedDict()  # doc_id -> hit, oldest first
        self.kb_calls = 0
        self._lock = threading.Lock()  # verification may run on a worker thread

    def guess(self, query: str, k: int) -> list[Hit]:
        """The cache's top-``k`` for ``query``: the knowledge base's answer if it is cached."""
        with self._lock:
            cached = list(self.cache.values())
        if not cached:
            return []
        scores = self.owner.scorer.score(query, cached)
        order = np.argsort(-scores, kind="stable")[:k]
        return [cached[i] for i in order]

    def verify(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        """The knowledge base's top-``k`` for each query, in one call; all results are cached."""
        wanted = max(k, self.owner.prefetch)
        fetched = self.owner.scorer.fetch(lambda: self.owner.retriever.search(list(queries),
                                                                              wanted))
        with self._lock:
            self.kb_calls += 1
            for hits in fetched:
                for hit in hits:
                    self.cache[hit.doc_id] = hit
                    self.cache.move_to_end(hit.doc_id)
            while len(self.cache) > self.owner.capacity:
                self.cache.popitem(last=False)
        return [hits[:k] for hits in fetched]


def same_passages(a: Sequence[Hit], b: Sequence[Hit]) -> bool:
    return [h.doc_id for h in a] == [h.doc_id for h in b]
