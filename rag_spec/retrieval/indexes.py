"""Search structures over passages: dense faiss (flat / HNSW / IVF) and sparse BM25.

Both answer a batch of query strings with one call and return ``(scores, ids)`` arrays of shape
(n_queries, k), best first; ids of -1 mark missing hits (k larger than the corpus).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rag_spec.errors import RagSpecError
from rag_spec.retrieval.embedder import Embedder
from rag_spec.retrieval.flat_search import (
    PackedVectors,
    flat_vectors,
    largest_norm,
    top_k_inner_product,
)

DENSE_KINDS = ("flat", "hnsw", "ivf")
KINDS = (*DENSE_KINDS, "bm25")
HNSW_M, HNSW_EF_CONSTRUCTION, HNSW_EF_SEARCH = 32, 80, 64
IVF_NPROBE = 8


class DenseIndex:
    """A faiss inner-product index over unit vectors, searched with the embedder's queries."""

    def __init__(self, kind: str, cpu_index: Any, embedder: Embedder) -> None:
        self.kind = kind
        self.cpu_index = cpu_index  # kept for saving; `index` may be a GPU copy of it
        self.index = _maybe_on_gpu(cpu_index, kind)
        self.embedder = embedder
        self.packed: PackedVectors | None = None
        self.max_norm: float | None = None  # of the flat index's vectors, once searched

    @classmethod
    def build(cls, kind: str, vectors: np.ndarray, embedder: Embedder) -> DenseIndex:
        """Index ``vectors`` (n, dim), unit length, so inner product is cosine similarity."""
        import faiss

        n, dim = vectors.shape
        if kind == "flat":
            index = faiss.IndexFlatIP(dim)
        elif kind == "hnsw":
            index = faiss.IndexHNSWFlat(dim, HNSW_M, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = HNSW_EF_CONSTRUCTION
            index.hnsw.efSearch = HNSW_EF_SEARCH
        else:
            # ~sqrt(n) lists, but at least 39 training points per list, as faiss asks.
            nlist = max(1, min(int(math.sqrt(n)), n // 39))
            quantizer = faiss.IndexFlatIP(dim)
            index = faiss.IndexIVFFlat(quantizer, dim, nlist, faiss.METRIC_INNER_PRODUCT)
            index.train(vectors)
            index.nprobe = min(IVF_NPROBE, nlist)
        index.add(vectors)
        return cls(kind, index, embedder)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        return self.search_vectors(self.embedder.encode_queries(queries), k)

    def pack(self) -> None:
        """See KnowledgeBase.pack."""
        if self.kind != "flat" or self.index is not self.cpu_index:
            msg = f"Only a flat index searched on CPU can be packed (this one is {self.kind})."
            raise RagSpecError(msg)
        self.packed = PackedVectors(flat_vectors(self.index))

    def search_vectors(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        if self.kind == "flat" and self.index is self.cpu_index:  # exact, on CPU: see flat_search
            plain = flat_vectors(self.index)
            if self.max_norm is None:
                self.max_norm = largest_norm(plain)
            stored = self.packed if self.packed is not None else plain
            return _pad(*top_k_inner_product(stored, vectors, k, max_norm=self.max_norm), k)
        scores, ids = self.index.search(vectors, k)
        return scores, ids

    def score(self, queries: Sequence[str], doc_ids: Sequence[int]) -> np.ndarray:
        """[n_queries, n_docs] inner products: the index's own metric, computed locally."""
        if self.kind == "ivf":
            self.cpu_index.make_direct_map()
        vectors = self.cpu_index.reconstruct_batch(np.asarray(doc_ids, dtype=np.int64))
        return self.embedder.encode_queries(queries) @ vectors.T

    def mismatch(self, passages: int) -> str:
        """Why this index cannot point into ``passages`` passages with its embedder ("" if it
        can)."""
        if self.cpu_index.ntotal != passages:
            return f"it holds {self.cpu_index.ntotal} vectors"
        if self.cpu_index.d != self.embedder.dim:
            return (f"its vectors have {self.cpu_index.d} dimensions, the embedder's "
                    f"{self.embedder.dim}")
        return ""

    def save(self, folder: Path) -> None:
        import faiss

        faiss.write_index(self.cpu_index, str(folder / "index.faiss"))

    @classmethod
    def load(cls, kind: str, folder: Path, embedder: Embedder) -> DenseIndex:
        import faiss

        index = faiss.read_index(str(folder / "index.faiss"))
        if kind == "hnsw":
            index.hnsw.efSearch = HNSW_EF_SEARCH
        return cls(kind, index, embedder)


class BM25Index:
    """Okapi BM25 (bm25s) with English stop words; its vocabulary is fixed at build time."""

    kind = "bm25"

    def __init__(self, tokenizer: Any, bm25: Any) -> None:
        self.tokenizer = tokenizer
        self.bm25 = bm25

    @classmethod
    def build(cls, texts: Sequence[str]) -> BM25Index:
        import bm25s
        from bm25s.tokenization import Tokenizer

        tokenizer = Tokenizer(stopwords="en")
        ids = tokenizer.tokenize(list(texts), return_as="tuple", show_progress=False)
        bm25 = bm25s.BM25()
        bm25.index(ids, show_progress=False)
        return cls(tokenizer, bm25)

    def search(self, queries: Sequence[str], k: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids",
                                      show_progress=False)
        n_docs = int(self.bm25.scores["num_docs"])
        found, scores = self.bm25.retrieve(ids, k=min(k, n_docs), show_progress=False,
                                           n_threads=0)
        return _pad(scores.astype(np.float32), found.astype(np.int64), k)

    def score(self, queries: Sequence[str], doc_ids: Sequence[int]) -> np.ndarray:
        """[n_queries, n_docs] BM25 scores with the whole corpus's statistics."""
        ids = self.tokenizer.tokenize(list(queries), update_vocab=False, return_as="ids",
                                      show_progress=False)
        docs = np.asarray(doc_ids, dtype=np.int64)
        return np.stack([self.bm25.get_scores(q)[docs] if q else np.zeros(len(docs))
                         for q in ids]).astype(np.float32)

    def mismatch(self, passages: int) -> str:
        """Why this index cannot point into ``passages`` passages ("" if it can)."""
        n_docs = int(self.bm25.scores["num_docs"])
        if n_docs != passages:
            return f"it indexes {n_docs} documents"
        ids = np.asarray(self.bm25.scores["indices"])
        if ids.size and (ids.min() < 0 or ids.max() >= passages):
            return f"it holds document ids from {ids.min()} to {ids.max()}"
        return ""

    def save(self, folder: Path) -> None:
        self.bm25.save(str(folder / "bm25"), show_progress=False)
        self.tokenizer.save_vocab(str(folder))

    @classmethod
    def load(cls, folder: Path) -> BM25Index:
        import bm25s
        from bm25s.tokenization import Tokenizer

        bm25 = bm25s.BM25.load(str(folder / "bm25"), show_progress=False)
        tokenizer = Tokenizer(stopwords="en")
        tokenizer.load_vocab(str(folder))
        return cls(tokenizer, bm25)


def _pad(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad to k columns with id -1, as faiss does."""
    missing = k - ids.shape[1]
    if missing <= 0:
        return scores, ids
    return (np.pad(scores, ((0, 0), (0, missing)), constant_values=-np.inf),
            np.pad(ids, ((0, 0), (0, missing)), constant_values=-1))


def _maybe_on_gpu(index: Any, kind: str) -> Any:
    """A GPU copy of flat / IVF indexes when faiss-gpu and a GPU are present (HNSW stays on CPU)."""
    import faiss

    if kind == "hnsw" or not hasattr(faiss, "index_cpu_to_all_gpus"):
        return index
    if faiss.get_num_gpus() < 1:
        return index
    return faiss.index_cpu_to_all_gpus(index)
