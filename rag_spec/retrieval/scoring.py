"""How speculative retrieval ranks the passages it has cached, without calling the store.

A guess is the cache's top-k under the knowledge base's own metric: whenever the store's true
top-k is cached, the guess is right. Two scorers, chosen by what the retriever offers:

- ``IndexScorer``: the retriever implements ``LocalScoring`` (``score(queries, doc_ids)``
  computed in this process), as rag_spec's local knowledge bases (faiss, BM25) do.
- ``VectorScorer``: anything else, a remote store or a user's own client. The query is
  embedded here and compared with each cached passage's vector by inner product (cosine on
  unit vectors): the vector the store returned with the hit (Milvus does), or the passage's
  text embedded here once. With the store's own embedder and metric this is the store's
  ranking; with another, guesses are right less often and outputs are still the naive loop's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.types import Hit


@runtime_checkable
class LocalScoring(Protocol):
    """A retriever that scores chosen passages in this process, with its own metric."""

    def score(self, queries: Sequence[str], doc_ids: Sequence[int]) -> np.ndarray:
        """[n_queries, n_docs] scores, higher is better."""
        ...


class GuessScorer(Protocol):
    """Scores cached hits for one query; higher is better. Never calls the store."""

    def prepare(self, hits: Sequence[Hit]) -> None:
        """Called as hits enter a cache, on the verifying thread: work done here is off the
        guess's path (which runs on the decoding thread)."""
        ...

    def score(self, query: str, hits: Sequence[Hit]) -> np.ndarray: ...


class IndexScorer:
    """The knowledge base's own local ``score``."""

    def __init__(self, retriever: LocalScoring) -> None:
        self.retriever = retriever

    def prepare(self, hits: Sequence[Hit]) -> None:
        """Nothing to prepare: the index holds every passage."""

    def score(self, query: str, hits: Sequence[Hit]) -> np.ndarray:
        return np.asarray(self.retriever.score([query], [h.doc_id for h in hits]))[0]


class VectorScorer:
    """Inner products of embeddings made here: the query's, and each passage's unless the store
    sent its vector. Passage vectors are remembered by id (``memory`` of them, least recently
    used leave first), so a passage's text is embedded once however many sessions see it."""

    def __init__(self, embedder: Embedder | None = None, *, memory: int = 4096) -> None:
        self.embedder = embedder or Embedder.default()
        self.memory = memory
        self._vectors: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()

    def prepare(self, hits: Sequence[Hit]) -> None:
        """Embed the texts of hits that came without vectors, so guesses need not."""
        self.vectors(hits)

    def score(self, query: str, hits: Sequence[Hit]) -> np.ndarray:
        query_vector = self.embedder.encode_queries([query])[0]
        return self.vectors(hits) @ query_vector

    def vectors(self, hits: Sequence[Hit]) -> np.ndarray:
        """[len(hits), dim] passage vectors, embedding only the texts not seen before."""
        with self._lock:
            known = {h.doc_id: self._vectors[h.doc_id] for h in hits
                     if h.vector is None and h.doc_id in self._vectors}
            for doc_id in known:
                self._vectors.move_to_end(doc_id)
        missing = {h.doc_id: h.text for h in hits if h.vector is None and h.doc_id not in known}
        if missing:
            fresh = dict(zip(missing, self.embedder.encode(list(missing.values()))))
            known.update(fresh)
            with self._lock:
                self._vectors.update(fresh)
                while len(self._vectors) > self.memory:
                    self._vectors.popitem(last=False)
        rows = [known[h.doc_id] if h.vector is None else h.vector for h in hits]
        if not rows:  # a verification that found nothing
            return np.zeros((0, self.embedder.dim), dtype=np.float32)
        return np.asarray(np.stack(rows), dtype=np.float32)


def scorer_for(retriever: object) -> GuessScorer:
    """The scorer that ranks like ``retriever``: its local ``score`` where it has one, else
    vectors from its ``embedder`` attribute (or the default embedder)."""
    if isinstance(retriever, LocalScoring):
        return IndexScorer(retriever)
    embedder = getattr(retriever, "embedder", None)
    return VectorScorer(embedder if isinstance(embedder, Embedder) else None)
