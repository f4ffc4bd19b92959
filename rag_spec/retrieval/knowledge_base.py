"""A knowledge base: passages plus one search index, built once and persisted under the cache.

Layout on disk (``<cache>/kb/<corpus>/``)::

    embeddings-<fingerprint>.npy   passage vectors, shared by the flat / hnsw / ivf indexes
    <kind>/meta.json               corpus fingerprint, embedder, kind, sizes, build time
    <kind>/index.faiss | bm25/     the index itself

Every write goes to a scratch path first, so a crash leaves the previous index usable.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from rag_spec.corpus import DEFAULT_SOURCES, Passage, fingerprint, load_passages
from rag_spec.errors import RagSpecError
from rag_spec.paths import atomic_dir, atomic_file, cache_dir
from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.indexes import DENSE_KINDS, KINDS, BM25Index, DenseIndex
from rag_spec.retrieval.types import Hit, check_search_args

_defaults: dict[str, KnowledgeBase] = {}
_defaults_lock = threading.Lock()


class KnowledgeBase:
    """Passages searchable in batches: ``search(queries, k) -> list[list[Hit]]``.

    Examples:
        >>> kb = KnowledgeBase.load_default(kind="flat")        # doctest: +SKIP
        >>> kb.search(["join two paths"], k=1)[0][0].title       # doctest: +SKIP
        'posixpath.join'
    """

    def __init__(self, passages: Sequence[Passage], index: DenseIndex | BM25Index) -> None:
        self.passages = list(passages)
        self.index = index
        self.kind = index.kind

    def __len__(self) -> int:
        return len(self.passages)

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        """Top-``k`` passages for each query, best first, in one batched index call."""
        check_search_args(queries, k)
        if not queries:
            return []
        scores, ids = self.index.search(list(queries), k)
        return [[self.hit(int(i), float(s)) for s, i in zip(row_s, row_i) if i >= 0]
                for row_s, row_i in zip(scores, ids)]

    def score(self, queries: Sequence[str], doc_ids: Sequence[int]) -> np.ndarray:
        """[n_queries, n_docs] scores of chosen passages with the index's own metric.

        Ranking a few cached passages this way puts the knowledge base's top-1 first whenever
        it is among them, which is what makes speculative retrieval's guesses worth verifying.
        """
        if not doc_ids:
            return np.zeros((len(queries), 0), dtype=np.float32)
        return self.index.score(list(queries), list(doc_ids))

    def pack(self) -> None:
        """Keep a copy of a flat index's vectors in oneDNN's blocked layout (CPU only; as much
        memory again, ~2 s per 1M vectors to build). A batch of up to 16 queries then costs
        about what one does, which makes speculative retrieval's batched verifications cheap
        (unpacked, eight cost about twice one; ``rag-spec bench ralm --packed``)."""
        if not isinstance(self.index, DenseIndex):
            msg = f"Only a flat (exact) index can be packed; this one is {self.kind}."
            raise RagSpecError(msg)
        self.index.pack()

    def hit(self, doc_id: int, score: float) -> Hit:
        passage = self.passages[doc_id]
        return Hit(doc_id=doc_id, score=score, title=passage.title, text=passage.text)

    # -- building and opening ------------------------------------------------------------------

    @classmethod
    def build(cls, passages: Sequence[Passage], kind: str = "flat", *,
              embedder: Embedder | None = None, vectors: np.ndarray | None = None,
              progress: bool = False) -> KnowledgeBase:
        """Index ``passages`` in memory (``vectors`` may be passed to skip the embedding)."""
        _check_kind(kind)
        if not passages:
            msg = "Cannot build a knowledge base from no passages. Give it at least one document."
            raise RagSpecError(msg)
        texts = [p.text for p in passages]
        if kind == "bm25":
            return cls(passages, BM25Index.build(texts))
        embedder = embedder or Embedder()
        if vectors is None:
            vectors = embedder.encode(texts, progress=progress)
        return cls(passages, DenseIndex.build(kind, vectors, embedder))

    @classmethod
    def load_default(cls, kind: str = "flat", *, progress: bool = True) -> KnowledgeBase:
        """The default knowledge base (standard-library docstrings), built on first use and
        opened once per process."""
        with _defaults_lock:
            if kind not in _defaults:
                _defaults[kind] = cls.open(DEFAULT_SOURCES, kind, progress=progress)
            return _defaults[kind]

    @classmethod
    def open(cls, sources: Sequence[str] = DEFAULT_SOURCES, kind: str = "flat", *,
             rebuild: bool = False, progress: bool = True) -> KnowledgeBase:
        """Load the persisted index for ``sources``, building and saving it if it is missing."""
        _check_kind(kind)
        passages = load_passages(sources)
        store = _Store(corpus_dir(sources), fingerprint(passages))
        embedder = None if kind == "bm25" else Embedder.default()
        if rebuild or not store.has(kind):
            if progress:
                print(f"rag-spec: building the {kind} index over {len(passages)} passages "
                      f"from {', '.join(sources)} (once; saved under {store.root}).")
            started = time.perf_counter()
            vectors = None if embedder is None else store.vectors(passages, embedder, progress)
            kb = cls.build(passages, kind, embedder=embedder, vectors=vectors)
            store.save(kb, embedder, time.perf_counter() - started)
            return kb
        return cls(passages, store.load(kind, embedder, len(passages)))


def passage_vectors(sources: Sequence[str], passages: Sequence[Passage], embedder: Embedder,
                    progress: bool = True) -> np.ndarray:
    """The embeddings of ``sources``' passages, computed once and cached beside its indexes
    (every dense kind, local or Milvus, shares them)."""
    return _Store(corpus_dir(sources), fingerprint(passages)).vectors(passages, embedder, progress)


def corpus_dir(sources: Sequence[str]) -> Path:
    """The cache folder of a corpus: readable for the default, hashed for folder lists."""
    if tuple(sources) == DEFAULT_SOURCES:
        name = "stdlib"
    else:
        resolved = [s if s == "stdlib" or s.startswith("pkg:") else str(Path(s).resolve())
                    for s in sources]
        name = "corpus-" + hashlib.sha256("\n".join(resolved).encode()).hexdigest()[:12]
    return cache_dir() / "kb" / name


class _Store:
    """Reads and writes one corpus's indexes, refusing any built from other passages."""

    def __init__(self, root: Path, corpus_fingerprint: str) -> None:
        self.root = root
        self.fingerprint = corpus_fingerprint

    def has(self, kind: str) -> bool:
        return (self.root / kind / "meta.json").is_file()

    def vectors(self, passages: Sequence[Passage], embedder: Embedder,
                progress: bool) -> np.ndarray:
        """Passage embeddings, computed once per corpus and embedder and shared by dense kinds;
        a saved file that does not hold one sound vector per passage is computed again."""
        path = self.root / f"embeddings-{self.fingerprint}-{embedder.name}.npy"
        if path.is_file():
            problem = _embeddings_problem(path, len(passages), embedder.dim)
            if not problem:
                return np.load(path)
            print(f"rag-spec: the saved embeddings {path.name} are damaged ({problem}); "
                  "computing them again.")
            path.unlink()
        vectors = embedder.encode([p.text for p in passages], progress=progress)
        with atomic_file(path) as scratch, scratch.open("wb") as out:
            np.save(out, vectors)
        return vectors

    def save(self, kb: KnowledgeBase, embedder: Embedder | None, seconds: float) -> None:
        meta = {"kind": kb.kind, "fingerprint": self.fingerprint, "passages": len(kb),
                "embedder": embedder.name if embedder else None,
                "build_seconds": round(seconds, 2)}
        with atomic_dir(self.root / kb.kind) as scratch:
            kb.index.save(scratch)
            (scratch / "meta.json").write_text(json.dumps(meta, indent=2))

    def load(self, kind: str, embedder: Embedder | None,
             passages: int) -> DenseIndex | BM25Index:
        """The saved index, checked against the passages it must point into."""
        folder = self.root / kind
        rebuild = f"`rag-spec index build --kind {kind} --rebuild` rebuilds it"
        try:
            meta = json.loads((folder / "meta.json").read_text())
        except (OSError, ValueError) as err:
            msg = f"The {kind} index in {folder} has an unreadable meta.json ({err}); {rebuild}."
            raise RagSpecError(msg) from err
        if not isinstance(meta, dict):
            msg = (f"The {kind} index in {folder} has a meta.json that is not an object; "
                   f"{rebuild}.")
            raise RagSpecError(msg)
        expected_embedder = embedder.name if embedder else None
        if meta.get("fingerprint") != self.fingerprint or meta.get("embedder") != expected_embedder:
            msg = (f"The {kind} index in {folder} was built from other passages or another "
                   f"embedder (index: {meta.get('fingerprint')}/{meta.get('embedder')}, now: "
                   f"{self.fingerprint}/{expected_embedder}), so its ids would point at the wrong "
                   f"text; {rebuild}.")
            raise RagSpecError(msg)
        if kind in DENSE_KINDS and embedder is None:
            msg = f"A {kind} index searches by embeddings: give the knowledge base an Embedder."
            raise RagSpecError(msg)
        try:
            index = (DenseIndex.load(kind, folder, embedder) if kind in DENSE_KINDS
                     else BM25Index.load(folder))
            problem = index.mismatch(passages)
        except Exception as err:  # faiss raises RuntimeError, bm25s ValueError/OSError
            msg = f"The {kind} index in {folder} is damaged and cannot be read ({err}); {rebuild}."
            raise RagSpecError(msg) from err
        if problem:
            msg = (f"The {kind} index in {folder} does not match its {passages} passages "
                   f"({problem}), so its answers would cite the wrong text; {rebuild}.")
            raise RagSpecError(msg)
        return index


def _embeddings_problem(path: Path, passages: int, dim: int) -> str:
    """Why a saved embeddings file cannot serve ``passages`` vectors of ``dim`` ("" if it can)."""
    try:
        vectors = np.load(path, mmap_mode="r")
    except (OSError, ValueError) as err:
        return f"unreadable: {err}"
    if vectors.shape != (passages, dim) or vectors.dtype != np.float32:
        return f"{vectors.dtype} {vectors.shape} instead of float32 ({passages}, {dim})"
    if not np.isfinite(vectors).all():
        return "it holds NaN or infinite values"
    return ""


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        msg = f"Unknown index kind {kind!r}; use one of {', '.join(KINDS)}."
        raise RagSpecError(msg)
