"""The Milvus knowledge base on milvus-lite (started by rag-spec itself), speculated, and its
faults: a server that stops or hangs mid-request or mid-build, an unreachable URI, a collection
built with another embedder."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from conftest import WORDS, SharedClock, char_lm
from rag_spec.bench.simulated import SearchOnly
from rag_spec.corpus import load_passages
from rag_spec.errors import RagSpecError
from rag_spec.retrieval import KnowledgeBase
from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.milvus import MilvusKnowledgeBase, build, connect
from rag_spec.retrieval.milvus_lite import LiteServer
from rag_spec.retrieval.scoring import VectorScorer
from rag_spec.retrieval.spec_retriever import SpecRetriever
from rag_spec.serving.ralm import IterativeRaLM, RaLMSpeculation

pytestmark = pytest.mark.slow  # starts milvus-lite servers: seconds each

pytest.importorskip("milvus_lite")


def write_corpus(folder, files=12):
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        lines = [" ".join(rng.choice(WORDS, 8)) + "." for _ in range(6)]
        (folder / f"note{i}.txt").write_text(f"note {i}\n\n" + "\n".join(lines))
    return str(folder)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "notes")


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A milvus-lite folder, its server stopped once the module's tests are done."""
    folder = tmp_path_factory.mktemp("milvus") / "kb.db"
    yield str(folder)
    LiteServer.serving(folder).stop()


@pytest.fixture(scope="module")
def kb(corpus, store):
    return MilvusKnowledgeBase.open([corpus], uri=store, index="flat", progress=False,
                                    timeout=5)


def server(store):
    return LiteServer.serving(store)


def test_search_ranks_as_the_local_exact_index_and_returns_vectors(kb, corpus):
    local = KnowledgeBase.build(load_passages([corpus]), "flat")
    queries = ["alpha beta gamma", "omega sigma", "kappa theta delta"]
    remote = kb.search(queries, k=3)
    assert [[h.text for h in hits] for hits in remote] == \
        [[h.text for h in hits] for hits in local.search(queries, k=3)]
    assert all(h.vector is not None and h.vector.shape == (Embedder.default().dim,)
               for hits in remote for h in hits)
    assert len(kb) == len(local)


def test_reopening_serves_the_same_collection_without_building(kb, corpus, store):
    again = MilvusKnowledgeBase.open([corpus], uri=store, progress=False)
    assert again.client.describe_alias(again.alias)["collection_name"] == \
        kb.client.describe_alias(kb.alias)["collection_name"]


class Counting:
    def __init__(self, retriever):
        self.retriever, self.calls = retriever, 0

    def search(self, queries, k=1):
        self.calls += 1
        return self.retriever.search(queries, k)

    def __getattr__(self, name):
        return getattr(self.retriever, name)


@pytest.mark.parametrize("wrap", [lambda kb: kb, SearchOnly], ids=["vectors", "search-only"])
def test_guesses_are_scored_locally_and_rank_like_the_store(kb, wrap):
    counted = Counting(wrap(kb))
    assert isinstance(SpecRetriever(counted).scorer, VectorScorer)
    spec = SpecRetriever(counted, prefetch=8, scorer=VectorScorer(kb.embedder, depth=8))
    rng = np.random.default_rng(3)
    checked = 0
    for _ in range(8):
        session = spec.session()
        session.verify([" ".join(rng.choice(WORDS, 3)) for _ in range(2)], k=1)
        spec.scorer.embed_pending()  # search-only: texts are embedded during later calls
        calls = counted.calls
        query = " ".join(rng.choice(WORDS, 4))
        guess = session.guess(query, k=1)
        assert counted.calls == calls  # no call to the store per guess
        truth = kb.search([query], k=1)[0][0]
        if truth.doc_id in session.cache:
            assert guess[0].doc_id == truth.doc_id
            checked += 1
    assert checked >= 4


@pytest.fixture(scope="module")
def lm():
    return char_lm(window=2048)


QUESTION = "which word comes after alpha beta?"


class UntilEmbedded:
    """A store whose round trip lasts until the guess scorer has embedded every passage it
    queued (the search runs on the I/O pool while the verifying thread embeds), and costs
    ``latency`` on ``clock`` (a remote store: dearer than a guess, whatever this machine's
    Milvus Lite and embedder take)."""

    def __init__(self, retriever, clock, latency=0.05):
        self.retriever, self.clock, self.latency = retriever, clock, latency
        self.scorer = None

    def search(self, queries, k=1):
        while self.scorer is not None and getattr(self.scorer, "queued", 0):
            time.sleep(0.001)  # waits for an event; asserts no duration
        self.clock.wait(self.latency)
        return self.retriever.search(queries, k)

    def __getattr__(self, name):
        return getattr(self.retriever, name)


@pytest.mark.parametrize("wrap", [lambda kb: kb, SearchOnly], ids=["vectors", "search-only"])
def test_speculative_ralm_on_milvus_equals_the_naive_loop(lm, kb, wrap):
    expected = IterativeRaLM(lm, kb, stride=2, query_tokens=12).generate(QUESTION, 30)
    # a round trip that lasts until a search-only client's passages are embedded meanwhile
    # (event order: a fixed delay left them unembedded, so unguessed, on busy cores); its cost
    # on an injected clock, or a busy machine's timings could stop the guessing (a guess
    # timed dearer than a call). One clock for the I/O pool's thread, where a search-only
    # client's call waits, and the loop's, which times it; verification in the foreground, so
    # no call's wait falls inside a guess's timing.
    clock = SharedClock()
    store = UntilEmbedded(wrap(kb), clock)
    spec = IterativeRaLM(lm, SpecRetriever(store), stride=2, query_tokens=12,
                         speculation=RaLMSpeculation(stride=3, os3=False, asynchronous=False))
    spec.clock = clock
    store.scorer = spec.retriever.scorer
    result = spec.generate(QUESTION, 30)
    assert result.token_ids == expected.token_ids
    assert result.stats.speculation_hits > 0
    assert result.stats.kb_calls < expected.stats.kb_calls


def verify_threads():
    return [t for t in threading.enumerate() if t.name.startswith("rag-spec-verify")]


class StopsTheServer:
    """The server process stops while the loop's requests are in flight (the third call)."""

    def __init__(self, kb, store):
        self.kb, self.store, self.calls = kb, store, 0

    def search(self, queries, k=1):
        self.calls += 1
        if self.calls == 3:
            server(self.store).stop()
        return self.kb.search(queries, k)


def requests_deadlines(kb, monkeypatch):
    """The deadline of every search ``kb`` sends from now on (the client is spied, not
    replaced: a reconnect's fresh client is spied too)."""
    seen = []
    request = kb._request

    def spied(client, vectors, k):
        search = client.search
        client.search = lambda *a, **kw: seen.append(kw["timeout"]) or search(*a, **kw)
        try:
            return request(client, vectors, k)
        finally:
            client.search = search

    monkeypatch.setattr(kb, "_request", spied)
    return seen


def test_a_local_server_that_stops_mid_request_is_started_again(lm, kb, store):
    expected = IterativeRaLM(lm, kb, stride=1, query_tokens=12).generate(QUESTION, 20)
    spec = IterativeRaLM(lm, SpecRetriever(StopsTheServer(kb, store)), stride=1, query_tokens=12,
                         speculation=RaLMSpeculation(stride=2, os3=False))
    assert spec.generate(QUESTION, 20).token_ids == expected.token_ids
    assert server(store).running()


def test_a_remote_server_that_stops_mid_request_is_a_clear_error_then_recovers(
        lm, kb, corpus, store, monkeypatch):
    remote = MilvusKnowledgeBase.open([corpus], uri=server(store).uri, progress=False,
                                      timeout=3)  # a server URI: rag-spec does not restart it
    expected = IterativeRaLM(lm, remote, stride=1, query_tokens=12).generate(QUESTION, 20)
    spec = IterativeRaLM(lm, SpecRetriever(StopsTheServer(remote, store)), stride=1,
                         query_tokens=12, speculation=RaLMSpeculation(stride=2, os3=False))
    deadlines = requests_deadlines(remote, monkeypatch)
    with pytest.raises(RagSpecError, match="is the server running at http://127.0.0.1"):
        spec.generate(QUESTION, 20)
    assert deadlines and set(deadlines) == {3}  # every request carried the 3 s deadline
    assert not verify_threads()
    server(store)  # the server is back, at the same address: the same loop answers again
    assert spec.generate(QUESTION, 20).token_ids == expected.token_ids


def test_a_hung_server_times_out_within_the_deadline(kb, store, monkeypatch):
    process = server(store).process
    deadlines = requests_deadlines(kb, monkeypatch)
    os.kill(process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RagSpecError, match="did not answer within 5 s|server running"):
            kb.search(["alpha"], k=1)
        assert deadlines and set(deadlines) == {kb.timeout}  # gRPC gives up at the deadline
    finally:
        os.kill(process.pid, signal.SIGCONT)
    assert kb.search(["alpha"], k=1)[0]


def test_an_interrupted_build_leaves_the_previous_collection_serving(kb, corpus, store):
    serving = kb.client.describe_alias(kb.alias)["collection_name"]
    before = kb.search(["alpha beta"], k=2)

    class DiesOnInsert:  # the server stops while the new collection is being filled
        def __init__(self, client):
            self.client = client

        def insert(self, *args, **kwargs):
            server(store).stop()
            return self.client.insert(*args, **kwargs)

        def __getattr__(self, name):
            return getattr(self.client, name)

    passages = load_passages([corpus])
    vectors = Embedder.default().encode([p.text for p in passages])
    with pytest.raises(Exception):  # noqa: B017 - whatever the client raises, nothing served
        build(DiesOnInsert(kb.client), kb.alias, passages, vectors, Embedder.default().name,
              index="flat", timeout=5)
    server(store)
    reopened = MilvusKnowledgeBase.open([corpus], uri=store, progress=False)
    assert reopened.client.describe_alias(kb.alias)["collection_name"] == serving
    assert [h.doc_id for h in reopened.search(["alpha beta"], k=2)[0]] == \
        [h.doc_id for h in before[0]]
    # A rebuild switches the alias, and drops the half-built and the replaced collections.
    rebuilt = MilvusKnowledgeBase.open([corpus], uri=store, index="flat", rebuild=True,
                                       progress=False)
    collections = rebuilt.client.list_collections()
    assert rebuilt.client.describe_alias(kb.alias)["collection_name"] != serving
    assert [c for c in collections if c.startswith(kb.alias)] == \
        [rebuilt.client.describe_alias(kb.alias)["collection_name"]]


def test_a_collection_built_with_another_embedder_or_corpus_is_refused(tmp_path, store):
    folder = write_corpus(tmp_path / "other", files=3)
    passages = load_passages([folder])
    client = connect(store, None, 5)
    vectors = Embedder.default().encode([p.text for p in passages])
    build(client, "rag_spec_elsewhere", passages, vectors, "another-embedder", index="flat")
    with pytest.raises(RagSpecError, match="another embedder.*--rebuild"):
        MilvusKnowledgeBase.open([folder], uri=store, collection="rag_spec_elsewhere",
                                 progress=False)
    (tmp_path / "other" / "new.txt").write_text("a new note about zeta eta iota and more.")
    build(client, "rag_spec_elsewhere", passages, vectors, Embedder.default().name,
          index="flat")
    with pytest.raises(RagSpecError, match="other passages"):
        MilvusKnowledgeBase.open([folder], uri=store, collection="rag_spec_elsewhere",
                                 progress=False)


def test_an_unreachable_uri_is_a_clear_error_within_its_deadline(monkeypatch):
    import pymilvus

    made = []
    client = pymilvus.MilvusClient
    monkeypatch.setattr(pymilvus, "MilvusClient",
                        lambda **kw: made.append(kw["timeout"]) or client(**kw))
    with pytest.raises(RagSpecError, match="is the server running at http://127.0.0.1:9"):
        MilvusKnowledgeBase.open(uri="http://127.0.0.1:9", timeout=2, progress=False)
    assert made == [2]  # the connection gives up at the caller's deadline


def test_bad_arguments(kb):
    with pytest.raises(RagSpecError, match="list of queries"):
        kb.search("alpha", k=1)
    with pytest.raises(RagSpecError, match="k must"):
        kb.search(["alpha"], k=0)
    with pytest.raises(RagSpecError, match="Unknown Milvus index"):
        MilvusKnowledgeBase.open(index="ivf")


def alive(pid):
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except FileNotFoundError:
        return False


def test_a_killed_process_leaves_no_server_holding_the_folder(tmp_path):
    import subprocess
    import sys

    script = ("import os\nfrom rag_spec.retrieval.milvus_lite import LiteServer\n"
              f"print(LiteServer.serving({str(tmp_path / 'kb.db')!r}).process.pid, flush=True)\n"
              "os._exit(0)\n")  # dies without running atexit, as a killed process would
    child = int(subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                               check=True, timeout=120).stdout.split()[-1])
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and alive(child):
        time.sleep(0.2)
    assert not alive(child)
    LiteServer.serving(tmp_path / "kb.db").stop()  # the folder can be served again
