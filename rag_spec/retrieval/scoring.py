"""How speculative retrieval ranks the passages it has cached, without calling the store.

A guess is the cache's top-k under the knowledge base's own metric: whenever the store's true
top-k is cached, the guess is right. Two scorers, chosen by what the retriever offers:

- ``IndexScorer``: the retriever implements ``LocalScoring`` (``score(queries, doc_ids)``
  computed in this process), as rag_spec's local knowledge bases (faiss, BM25) do.
- ``VectorScorer``: anything else, a remote store or a user's own client, embedding with the
  retriever's own embedder where it declares one (``EmbedderSearch``). The query is
  embedded here and compared with each cached passage's vector by inner product (cosine on
  unit vectors): the vector the store returned with the hit (Milvus does), or the passage's
  text embedded here once, while a round trip is in flight. With the store's own embedder and
  metric this is the store's ranking; with another, guesses are right less often and outputs
  are still the naive loop's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.types import Hit
from rag_spec.threads import start_io


@runtime_checkable
class LocalScoring(Protocol):
    """A retriever that scores chosen passages in this process, with its own metric."""

    def score(self, queries: Sequence[str], doc_ids: Sequence[int]) -> np.ndarray:
        """[n_queries, n_docs] scores, higher is better."""
        ...


@runtime_checkable
class EmbedderSearch(Protocol):
    """A retriever whose ranking is its ``embedder``'s vectors (Milvus): guesses embed with it
    too, so they rank as the store does."""

    embedder: Embedder


class GuessScorer(Protocol):
    """Scores cached hits for one query; higher is better. Never calls the store."""

    def fetch(self, search: Callable[[], list[list[Hit]]]) -> list[list[Hit]]:
        """Run a verification's store call (``search``) and take in the hits it returns, on the
        verifying thread: work done here is off the guess's path, and work done while the
        round trip is in flight costs no time."""
        ...

    def score(self, query: str, hits: Sequence[Hit]) -> np.ndarray: ...


class IndexScorer:
    """The knowledge base's own local ``score``."""

    def __init__(self, retriever: LocalScoring) -> None:
        self.retriever = retriever

    def fetch(self, search: Callable[[], list[list[Hit]]]) -> list[list[Hit]]:
        """Just the call: the index holds every passage already."""
        return search()

    def score(self, query: str, hits: Sequence[Hit]) -> np.ndarray:
        return np.asarray(self.retriever.score([query], [h.doc_id for h in hits]))[0]


class VectorScorer:
    """Inner products of embeddings made here: the query's, and each passage's unless the store
    sent its vector.

    Passage texts are embedded while a later verification's round trip is in flight
    (``fetch``): the store call runs on rag-spec's I/O pool and the verifying thread embeds
    queued texts, a ``chunk`` at a time, until the answer is back. The wait pays for the
    embedding, and neither the answer nor a guess waits for it. Until a passage's vector is
    ready it is not guessed (a guess may then miss, which only rolls back). Only each query's
    best ``depth`` hits are embedded, best ranks first: a passage ranked lower is rarely the
    next query's best, and each costs an embedding (on the RaLM bench behind Milvus, 5 of 20
    prefetched gave the fastest loop). Vectors are remembered by id (``memory`` of them, least
    recently used leave first), so a passage is embedded once however many sessions see it.
    """

    def __init__(self, embedder: Embedder | None = None, *, depth: int = 5,
                 memory: int = 4096, chunk: int = 2) -> None:
        self.embedder = embedder or Embedder.default()
        self.depth = depth
        self.memory = memory
        self.chunk = chunk  # texts per encode call: an answer waits for one chunk at most
        self._vectors: OrderedDict[int, np.ndarray] = OrderedDict()
        self._queue: OrderedDict[int, str] = OrderedDict()  # doc id -> text, best ranks first
        self._embedding: set[int] = set()  # taken from the queue, being embedded
        self._lock = threading.Lock()

    def fetch(self, search: Callable[[], list[list[Hit]]]) -> list[list[Hit]]:
        """Call the store, embedding queued texts until it answers; queue the answer's texts."""
        if not self._queue:
            fetched = search()
        else:
            request = start_io(search)
            while not request.done() and self._embed_next():
                pass
            fetched = request.result()
        by_rank = [hits[rank] for rank in range(self.depth) for hits in fetched
                   if rank < len(hits)]
        with self._lock:
            for hit in by_rank:
                if hit.vector is None and hit.doc_id not in self._vectors and \
                        hit.doc_id not in self._embedding:
                    self._queue.setdefault(hit.doc_id, hit.text)
            while len(self._queue) > self.memory:
                self._queue.popitem(last=False)
        return fetched

    @property
    def queued(self) -> int:
        """Passage texts waiting to be embedded."""
        with self._lock:
            return len(self._queue)

    def embed_pending(self) -> None:
        """Embed every queued text now (guesses then rank every cached passage as the store
        would)."""
        while self._embed_next():
            pass

    def score(self, query: str, hits: Sequence[Hit]) -> np.ndarray:
        """Each hit's inner product with the query; -inf where its vector is not ready."""
        scores = np.full(len(hits), -np.inf, dtype=np.float32)
        ready = self._ready(hits)
        if ready:
            rows = list(ready)
            query_vector = self.embedder.encode_queries([query])[0]
            scores[rows] = np.stack([ready[i] for i in rows]) @ query_vector
        return scores

    def _ready(self, hits: Sequence[Hit]) -> dict[int, np.ndarray]:
        """The vectors known for ``hits``, by position in ``hits``."""
        ready = {}
        with self._lock:
            for i, hit in enumerate(hits):
                if hit.vector is not None:
                    ready[i] = hit.vector
                elif hit.doc_id in self._vectors:
                    self._vectors.move_to_end(hit.doc_id)
                    ready[i] = self._vectors[hit.doc_id]
        return ready

    def _embed_next(self) -> bool:
        """Embed the next chunk of queued texts; False when none was queued."""
        with self._lock:
            chunk = dict(self._queue.popitem(last=False)
                         for _ in range(min(self.chunk, len(self._queue))))
            self._embedding.update(chunk)
        if not chunk:
            return False
        try:
            fresh = self.embedder.encode(list(chunk.values()))
        except BaseException:
            with self._lock:
                self._embedding.difference_update(chunk)
            raise
        with self._lock:
            self._vectors.update(zip(chunk, fresh))
            self._embedding.difference_update(chunk)
            while len(self._vectors) > self.memory:
                self._vectors.popitem(last=False)
        return True


def scorer_for(retriever: object) -> GuessScorer:
    """The scorer that ranks like ``retriever``: its local ``score`` where it has one, else
    vectors from its embedder (``EmbedderSearch``; the default embedder for any other)."""
    if isinstance(retriever, LocalScoring):
        return IndexScorer(retriever)
    # a user's client may name something else ``embedder`` (a LangChain ``Embeddings``)
    if isinstance(retriever, EmbedderSearch) and isinstance(retriever.embedder, Embedder):
        return VectorScorer(retriever.embedder)
    return VectorScorer()
