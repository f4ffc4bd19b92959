"""LangChain retrievers and vector stores behind rag_spec's Retriever interface: stable ids with
nothing remembered, k that reaches the search, one round trip per batch, higher-is-better
scores."""

import threading

from langchain_core.documents import Document
from langchain_core.retrievers import BaseRetriever
from langchain_core.vectorstores import VectorStore

from langchain_rag_spec._sources import LangChainSource

TEXTS = [f"passage number {i} about {word}" for i, word in
         enumerate(["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"])]


class DistanceStore(VectorStore):
    """A store that scores with a distance (lower is better), like many real ones; every search
    of a batch must be in flight at once to pass the barrier."""

    def __init__(self, barrier=None):
        self.barrier = barrier
        self.calls = 0

    def similarity_search_with_score(self, query, k=4, **kwargs):
        self.calls += 1
        if self.barrier is not None:
            self.barrier.wait()
        ranked = sorted(TEXTS, key=lambda t: (len(set(query) ^ set(t)), t))[:k]
        return [(Document(page_content=t), float(rank)) for rank, t in enumerate(ranked)]

    def similarity_search(self, query, k=4, **kwargs):
        return [d for d, _ in self.similarity_search_with_score(query, k)]

    def _select_relevance_score_fn(self):
        return lambda distance: 1.0 / (1.0 + distance)

    @classmethod
    def from_texts(cls, texts, embedding, metadatas=None, **kwargs):
        return cls()


class FixedK(BaseRetriever):
    """A retriever that returns its own k documents and takes no arguments."""

    k: int = 2

    def _get_relevant_documents(self, query, *, run_manager):
        return [Document(page_content=t) for t in TEXTS[:self.k]]


class SizedByK(BaseRetriever):
    def _get_relevant_documents(self, query, *, run_manager, k=2):
        return [Document(page_content=t) for t in TEXTS[:k]]


def test_ids_are_stable_and_nothing_is_remembered():
    source = LangChainSource(DistanceStore())
    first = source.search(["alpha", "beta"], k=3)
    again = source.search(["alpha"], k=3)
    assert [h.doc_id for h in first[0]] == [h.doc_id for h in again[0]]
    every = {h.text: h.doc_id for hits in first for h in hits}
    assert len(set(every.values())) == len(every)  # different passages, different ids
    assert not any(isinstance(v, dict) for v in vars(source).values())  # no id map to grow


def test_a_batch_of_store_searches_is_one_round_trip():
    store = DistanceStore(barrier=threading.Barrier(4, timeout=5))
    hits = LangChainSource(store).search(["a", "b", "c", "d"], k=2)  # hangs if one at a time
    assert [len(h) for h in hits] == [2] * 4 and store.calls == 4


def test_store_scores_are_higher_is_better():
    hits = LangChainSource(DistanceStore()).search(["alpha"], k=4)[0]
    scores = [h.score for h in hits]
    assert scores == sorted(scores, reverse=True) and scores[0] > scores[-1]


def test_k_reaches_retrievers_that_take_it_and_a_warning_names_the_limit(caplog):
    assert [len(h) for h in LangChainSource(SizedByK()).search(["a", "b"], k=5)] == [5, 5]
    with caplog.at_level("WARNING"):
        hits = LangChainSource(FixedK()).search(["a"], k=5)
    assert len(hits[0]) == 2
    assert "prefetching is limited" in caplog.text
