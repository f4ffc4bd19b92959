"""Knowledge bases: every index kind, batched search, persistence and its refusals."""

import json

import numpy as np
import pytest

from rag_spec.corpus import Passage
from rag_spec.errors import RagSpecError
from rag_spec.retrieval import KnowledgeBase
from rag_spec.retrieval.embedder import Embedder

TOPICS = ["json parsing of strings", "joining filesystem paths", "sorting lists in place",
          "regular expression matching", "spawning a subprocess", "reading csv files",
          "hashing bytes with sha256", "measuring elapsed time", "compressing data with zlib",
          "threads and locks for concurrency"]


@pytest.fixture(scope="module")
def embedder():
    return Embedder()


@pytest.fixture(scope="module")
def passages():
    rng = np.random.default_rng(0)
    out = [Passage(f"doc{i}", f"This passage is about {t}. " * 3) for i, t in enumerate(TOPICS)]
    filler = ["apple", "river", "stone", "cloud", "music", "paper", "glass", "train"]
    out += [Passage(f"filler{i}", " ".join(rng.choice(filler, 30))) for i in range(90)]
    return out


@pytest.mark.parametrize("kind", ["flat", "hnsw", "ivf", "bm25"])
def test_batched_search_finds_the_right_passage(embedder, passages, kind):
    kb = KnowledgeBase.build(passages, kind, embedder=embedder)
    queries = [f"about {t}" for t in TOPICS]
    hits = kb.search(queries, k=3)
    assert len(hits) == len(TOPICS)
    assert all(len(h) == 3 for h in hits)
    top1 = [h[0].title for h in hits]
    assert sum(t == f"doc{i}" for i, t in enumerate(top1)) >= 9
    assert all(h[0].score >= h[1].score >= h[2].score for h in hits)


def test_k_larger_than_the_corpus(embedder):
    kb = KnowledgeBase.build([Passage("a", "only one passage here")], "bm25")
    assert len(kb.search(["passage"], k=5)[0]) == 1


@pytest.mark.parametrize("queries, k, match", [
    ("one string", 1, "list"), (["q"], 0, "k must"),
    # every passage matches an empty query as well as any other: refused, as the CLI does
    ([""], 2, "query 0 is ''"), (["json", "  \n"], 1, r"query 1 is '  \\n'"),
])
@pytest.mark.parametrize("kind", ["bm25", "flat"])
def test_bad_search_arguments(passages, queries, k, match, kind):
    kb = KnowledgeBase.build(passages, kind)
    with pytest.raises(RagSpecError, match=match):
        kb.search(queries, k=k)


def test_no_passages_is_refused():
    with pytest.raises(RagSpecError, match="no passages"):
        KnowledgeBase.build([], "flat")


def test_unknown_kind_is_refused(passages):
    with pytest.raises(RagSpecError, match="hnsw"):
        KnowledgeBase.build(passages, "annoy")


def corpus_folder(tmp_path, passages):
    folder = tmp_path / "docs"
    folder.mkdir()
    for p in passages[:12]:
        (folder / f"{p.title}.txt").write_text(p.text)
    return folder


@pytest.mark.parametrize("kind", ["flat", "bm25"])
def test_open_builds_once_then_loads(tmp_path, passages, kind):
    folder = corpus_folder(tmp_path, passages)
    built = KnowledgeBase.open([str(folder)], kind, progress=False)
    loaded = KnowledgeBase.open([str(folder)], kind, progress=False)
    q = ["joining filesystem paths"]
    assert [h.doc_id for h in built.search(q, 3)[0]] == [h.doc_id for h in loaded.search(q, 3)[0]]


def test_changed_corpus_is_refused_not_misread(tmp_path, passages):
    folder = corpus_folder(tmp_path, passages)
    KnowledgeBase.open([str(folder)], "bm25", progress=False)
    (folder / "doc0.txt").write_text("entirely different words now " * 5)
    with pytest.raises(RagSpecError, match="other passages.*--rebuild"):
        KnowledgeBase.open([str(folder)], "bm25", progress=False)
    rebuilt = KnowledgeBase.open([str(folder)], "bm25", rebuild=True, progress=False)
    assert rebuilt.search(["entirely different"], 1)[0][0].title == "doc0.txt"


def test_corrupt_index_is_refused_with_the_fix(tmp_path, passages):
    from rag_spec.retrieval.knowledge_base import corpus_dir

    folder = corpus_folder(tmp_path, passages)
    KnowledgeBase.open([str(folder)], "flat", progress=False)
    (corpus_dir([str(folder)]) / "flat" / "index.faiss").write_bytes(b"garbage")
    with pytest.raises(RagSpecError, match="damaged.*--rebuild"):
        KnowledgeBase.open([str(folder)], "flat", progress=False)


def test_interrupted_build_leaves_the_previous_index(tmp_path, passages, monkeypatch):
    from rag_spec.retrieval import indexes
    from rag_spec.retrieval.knowledge_base import corpus_dir

    folder = corpus_folder(tmp_path, passages)
    KnowledgeBase.open([str(folder)], "bm25", progress=False)
    meta = corpus_dir([str(folder)]) / "bm25" / "meta.json"
    before = json.loads(meta.read_text())

    def crash(self, folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(indexes.BM25Index, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        KnowledgeBase.open([str(folder)], "bm25", rebuild=True, progress=False)
    monkeypatch.undo()
    assert json.loads(meta.read_text()) == before
    assert KnowledgeBase.open([str(folder)], "bm25", progress=False).search(["x"], 1)


def test_loading_the_embedder_leaves_the_process_environment_alone(monkeypatch):
    import os

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    assert Embedder().dim > 0  # a new instance: its model loads now
    assert "HF_HUB_OFFLINE" not in os.environ
