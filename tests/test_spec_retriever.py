"""SpecRetriever's cache ranking and the OS3 stride scheduler."""

import threading
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_spec.bench.simulated import SearchOnly
from rag_spec.corpus import Passage
from rag_spec.retrieval import KnowledgeBase
from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.os3 import (
    StrideScheduler,
    best_stride,
    expected_verified,
    fit_verification,
)
from rag_spec.retrieval.scoring import IndexScorer, VectorScorer
from rag_spec.retrieval.spec_retriever import SpecRetriever

VOCAB = ["path", "join", "json", "parse", "sort", "list", "file", "read", "time", "date",
         "thread", "lock", "zip", "hash", "random", "string", "split", "format"]


def random_passages(seed: int, n: int = 60) -> list[Passage]:
    rng = np.random.default_rng(seed)
    return [Passage(f"p{i}", " ".join(rng.choice(VOCAB, 12))) for i in range(n)]


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.mark.parametrize("kind", ["bm25", "flat"])
def test_kb_top1_in_cache_means_cache_top1(kind, embedder):
    # The cache ranks with the KB's own metric, so a cached KB top-1 is always the guess.
    rng = np.random.default_rng(1)
    checked = 0
    for seed in range(4):
        kb = KnowledgeBase.build(random_passages(seed), kind, embedder=embedder)
        spec = SpecRetriever(kb, prefetch=15)  # the cache holds most passages: often checked
        for _ in range(5):
            session = spec.session()
            session.verify([" ".join(rng.choice(VOCAB, 3)) for _ in range(3)], k=1)  # fill cache
            query = " ".join(rng.choice(VOCAB, 4))
            truth = kb.search([query], k=1)[0][0]
            if truth.doc_id in session.cache:
                assert session.guess(query, k=1)[0].doc_id == truth.doc_id
                checked += 1
    assert checked >= 10  # of 20 cases: the property was exercised, not skipped by chance


def test_prefetch_fills_the_cache_and_capacity_bounds_it():
    kb = KnowledgeBase.build(random_passages(0), "bm25")
    session = SpecRetriever(kb, prefetch=10, capacity=15).session()
    session.verify(["path join", "json parse"], k=1)
    assert len(session.cache) == 15  # 20 prefetched, the oldest 5 evicted
    assert session.kb_calls == 1


@pytest.mark.parametrize("search_only", [False, True])
def test_the_scorer_follows_what_the_retriever_offers(embedder, search_only):
    kb = KnowledgeBase.build(random_passages(0), "flat", embedder=embedder)
    spec = SpecRetriever(SearchOnly(kb) if search_only else kb)
    assert isinstance(spec.scorer, VectorScorer if search_only else IndexScorer)


def test_guesses_embed_with_the_embedder_the_retriever_declares():
    own = Embedder()  # not the process-wide default (its weights load on first use only)

    class Store:  # a remote store's client that says which embedder ranks its passages
        embedder = own

        def search(self, queries, k=1):
            return [[] for _ in queries]

    class LangChainish(Store):
        embedder = "an Embeddings object rag-spec cannot call"

    assert SpecRetriever(Store()).scorer.embedder is own
    assert SpecRetriever(LangChainish()).scorer.embedder is Embedder.default()
    assert SpecRetriever(SearchOnly(Store())).scorer.embedder is Embedder.default()


class CountingEmbedder:
    def __init__(self, embedder):
        self.embedder, self.texts = embedder, []

    def encode(self, texts, **kw):
        self.texts += list(texts)
        return self.embedder.encode(texts, **kw)

    def encode_queries(self, queries):
        return self.encode(queries)


def test_a_querys_vector_does_not_depend_on_its_batch(embedder):
    alone = embedder.encode(["thread lock"])[0]
    batch = Embedder(embedder.model_dir).encode_queries(["a much longer query about paths",
                                                         "thread lock", "zip"])
    assert np.array_equal(batch[1], alone)  # exactly: the naive loop searches with it
    assert np.array_equal(embedder.encode_queries(["thread lock"])[0], alone)


def test_vector_scorer_embeds_each_passage_once_and_uses_vectors_it_is_given(embedder):
    kb = KnowledgeBase.build(random_passages(1), "flat", embedder=embedder)
    hits = kb.search(["path join file"], k=6)[0]
    counting = CountingEmbedder(embedder)
    shallow = VectorScorer(counting, depth=2)  # type: ignore[arg-type]
    shallow.fetch(lambda: [hits, hits[::-1]])
    shallow.embed_pending()
    assert sorted(counting.texts) == sorted(h.text for h in hits[:2] + hits[-2:])  # best 2 each
    counting.texts.clear()
    scorer = VectorScorer(counting, depth=6)  # type: ignore[arg-type]
    assert scorer.fetch(lambda: [hits]) == [hits]
    assert np.isneginf(scorer.score("path join", hits)).all()  # queued: not guessable yet
    scorer.fetch(lambda: [hits])  # queued already: not queued twice
    scorer.embed_pending()
    first = scorer.score("path join", hits)
    assert len(counting.texts) == 1 + len(hits)  # one query, each passage once
    # The store's own metric, computed here: the knowledge base's order and scores.
    np.testing.assert_allclose(first, kb.score(["path join"], [h.doc_id for h in hits])[0],
                               rtol=1e-4, atol=1e-6)
    given = [replace(h, vector=embedder.encode([h.text])[0]) for h in hits]
    counting.texts.clear()
    scorer = VectorScorer(counting)  # type: ignore[arg-type]
    scorer.fetch(lambda: [given])  # more than ``depth``: a hit's own vector is always used
    scorer.embed_pending()
    np.testing.assert_allclose(scorer.score("path join", given), first, rtol=1e-4)
    assert counting.texts == ["path join"]  # the vectors came with the hits


class Gate:
    """A store whose answer is held back while ``closed``: the test opens it once the verifying
    thread has embedded ``after`` chunks, so what happens during a round trip is event order,
    not timing. Every event lands in ``events``."""

    def __init__(self, retriever, events, after=3):
        self.retriever, self.events, self.after = retriever, events, after
        self.open, self.answered = threading.Event(), threading.Event()
        self.called = threading.Event()
        self.open.set()

    def search(self, queries, k=1):
        self.events.append("call")
        self.called.set()
        assert self.open.wait(30), "the round trip was never overlapped with embedding"
        hits = self.retriever.search(queries, k)
        self.events.append("answer")
        self.answered.set()
        return hits


class GatedEmbedder(CountingEmbedder):
    """Counts chunks; the ``gate.after``-th opens the gate and waits for the store's answer
    (queries are embedded by the real embedder, uncounted)."""

    def __init__(self, embedder, gate):
        super().__init__(embedder)
        self.gate = gate

    def encode(self, texts, **kw):
        self.gate.called.wait(5)  # bounded: a chunk embedded before the call never sees it
        self.gate.events.append("chunk")
        vectors = super().encode(texts, **kw)
        if self.gate.events.count("chunk") == self.gate.after:
            self.gate.open.set()
            self.gate.answered.wait(30)
        return vectors

    def encode_queries(self, queries):
        return self.embedder.encode_queries(queries)


def test_texts_are_embedded_while_a_later_round_trip_is_in_flight(embedder):
    kb = KnowledgeBase.build(random_passages(2), "flat", embedder=embedder)
    events = []
    gate = Gate(SearchOnly(kb), events)
    slow = GatedEmbedder(embedder, gate)
    scorer = VectorScorer(slow, chunk=1)  # type: ignore[arg-type]
    session = SpecRetriever(gate, prefetch=10, scorer=scorer).session()
    truths = session.verify(["path join", "json parse"], k=1)
    assert events == ["call", "answer"] and not slow.texts  # the round trip only: nothing queued
    cached = list(session.cache.values())
    assert np.isneginf(scorer.score("path join", cached)).all()  # nothing guessable yet
    gate.open.clear()  # the next answer waits until three chunks are embedded
    gate.answered.clear()
    gate.called.clear()
    session.verify(["sort list"], k=1)
    # chunks were embedded during the round trip; once the answer was back, at most the one
    # chunk already started ran (embedding all cached texts first would be 19 chunks)
    after = events[events.index("answer", 2):]
    assert events[2:6] == ["call", "chunk", "chunk", "chunk"] and after.count("chunk") <= 1
    assert 3 <= len(slow.texts) < len(cached)  # the wait paid for some, best ranks first
    assert truths[0][0].text in slow.texts and truths[1][0].text in slow.texts
    scorer.embed_pending()
    slow.texts.clear()
    assert session.guess("path join", k=1) == truths[0]  # now ranked as the store ranks
    assert slow.texts == []  # a guess embeds its query only (encode_queries), no passage


def test_os3_reproduces_the_papers_strides():
    # RaLMSpec's scheduler with a=0.05 s, b=4.3 s gives s = 4 / 6 / 8 for gamma 0.3 / 0.5 / 0.6,
    # and s = 1 when verification is cheap (a=0.05, b=0.03).
    assert [best_stride(0.05, 4.3, g, False, 8) for g in (0.3, 0.5, 0.6)] == [4, 6, 8]
    assert best_stride(0.05, 0.03, 0.5, False, 8) == 1


@settings(max_examples=50, deadline=None)
@given(st.floats(0.001, 1), st.floats(0.001, 5), st.floats(0, 0.95), st.booleans(),
       st.floats(0, 1))
def test_os3_stride_is_the_argmax_of_the_objective(a, b, gamma, asynchronous, b_per_query):
    from rag_spec.retrieval.os3 import round_latency

    s = best_stride(a, b, gamma, asynchronous, 8, b_per_query)
    rates = [expected_verified(k, gamma)
             / round_latency(k, a, b + (k - 1) * b_per_query, gamma, asynchronous)
             for k in range(1, 9)]
    assert rates[s - 1] == max(rates)


def test_os3_fits_how_verification_grows_with_the_batch():
    # A local exact search: 0.2 s for one query and 0.05 s for each further one.
    assert fit_verification([(1, 0.2), (4, 0.35), (8, 0.55)]) == pytest.approx((0.2, 0.05))
    # A remote store's delay does not grow (the noise slope is clipped at 0) ...
    assert fit_verification([(2, 0.31), (6, 0.30)]) == pytest.approx((0.305, 0.0))
    # ... and one batch size alone says nothing about growth: the newest latency is used.
    assert fit_verification([(4, 0.3), (4, 0.5)]) == (0.5, 0.0)
    # Growth shortens the stride the paper's fixed b would pick (rates 2.29 vs 2.13 at s=2).
    assert best_stride(0.25, 0.2, 0.6, False, 8) == 2
    assert best_stride(0.25, 0.2, 0.6, False, 8, b_per_query=0.05) == 1


def test_scheduler_uses_the_fitted_verification_cost():
    scheduler = StrideScheduler()
    for queries, seconds in [(1, 0.2), (4, 0.35), (8, 0.55)]:
        scheduler.record_verification(seconds, queries, queries)
    scheduler.record_speculation(0.25)
    assert scheduler.next_stride() == best_stride(0.25, 0.2, 14 / 15, False, 8, 0.05)


def test_scheduler_estimates_gamma_over_a_window():
    scheduler = StrideScheduler(window=3)
    assert scheduler.next_stride() == 1  # cold start
    for speculated, matched in [(4, 4), (4, 1), (4, 4), (4, 2)]:  # the first falls out
        scheduler.record_verification(1.0, speculated, matched)
    scheduler.record_speculation(0.1)
    assert scheduler.gamma == pytest.approx(8 / 11)  # 7 matched, 2 rounds missed, prior 1 / 2
    assert scheduler.next_stride() == best_stride(0.1, 1.0, 8 / 11, False, 8)
    assert StrideScheduler(os3=False, fixed=5).next_stride() == 5


def test_async_only_while_verification_waits_rather_than_computes():
    scheduler = StrideScheduler(asynchronous=True)
    scheduler.record_cpu_share(cpu_seconds=0.01, wall_seconds=0.3)  # a remote store: waiting
    assert scheduler.overlaps()
    scheduler.record_cpu_share(cpu_seconds=0.5, wall_seconds=0.3)  # local search on all cores
    assert not scheduler.overlaps()
    assert not StrideScheduler(asynchronous=False).overlaps()


def test_a_resumed_scheduler_keeps_the_measurements_and_its_own_settings():
    earlier = StrideScheduler()
    for queries, seconds, matched in [(1, 0.2, 1), (4, 0.35, 3), (8, 0.55, 8)]:
        earlier.record_verification(seconds, queries, matched)
    earlier.record_speculation(0.25)
    earlier.record_cpu_share(cpu_seconds=0.5, wall_seconds=0.3)

    resumed = StrideScheduler(asynchronous=True)
    resumed.resume(earlier)
    assert resumed.gamma == earlier.gamma
    assert resumed.next_stride() == earlier.next_stride() > 1
    assert not resumed.overlaps()  # it already knows verification is CPU-bound
    fixed = StrideScheduler(os3=False, fixed=5)
    fixed.resume(earlier)
    assert fixed.next_stride() == 5


def test_a_search_only_retriever_that_finds_nothing_is_cached_as_nothing():
    class Nothing:
        def search(self, queries, k=1):
            return [[] for _ in queries]

    session = SpecRetriever(Nothing()).session()
    assert session.verify(["alpha"], k=1) == [[]]
    assert session.guess("alpha", k=1) == []
