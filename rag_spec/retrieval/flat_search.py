"""Exact inner-product top-k over a flat index's own vectors, with torch's matrix products.

On CPU, faiss's flat search below 20 queries grows with the batch (over 5M x 384 on 2 cores:
393 ms for one query, 866 ms for eight); a matrix product reads the vectors once per batch at
memory speed (~230 ms for one to four queries). A batch of queries then costs little more than
one, which is what batched verification of speculated retrievals relies on.

Past four queries the plain product becomes compute-bound (~550 ms for eight). A packed copy in
oneDNN's blocked layout (``PackedVectors``, twice the memory) keeps one to sixteen queries at
~240 ms.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from rag_spec.errors import RagSpecError
from rag_spec_kernels import onednn_ops_available, pack_weight, packed_linear

CHUNK_ROWS = 262_144  # rows scored at a time: bounds the score buffer to CHUNK_ROWS x queries
CONVERT_ROWS = 4_096  # float16 rows converted to float32 at a time


def flat_vectors(index: Any) -> torch.Tensor:
    """The vectors a faiss flat index stores, as a (ntotal, d) tensor sharing its memory."""
    import faiss

    flat = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)
    return torch.from_numpy(flat).view(index.ntotal, index.d)


class PackedVectors:
    """A copy of the vectors in oneDNN's blocked weight layout, chunk by chunk (~2 s per 1M x
    384 to build, as much memory again as the vectors)."""

    def __init__(self, vectors: torch.Tensor) -> None:
        if not onednn_ops_available():
            msg = ("Packing vectors needs a torch build with oneDNN (the x86 and ARM CPU wheels "
                   "from PyPI have it); search the flat index unpacked instead.")
            raise RagSpecError(msg)
        self.rows = len(vectors)
        self.chunks = [pack_weight(vectors[start:start + CHUNK_ROWS].contiguous())
                       for start in range(0, self.rows, CHUNK_ROWS)]

    def __len__(self) -> int:
        return self.rows

    def scores(self, queries: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, (queries, rows) inner products) per chunk."""
        for i, chunk in enumerate(self.chunks):
            yield i * CHUNK_ROWS, packed_linear(queries, chunk)


def _plain_scores(vectors: torch.Tensor,
                  queries: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    if len(queries) == 1:
        queries = queries.repeat(2, 1)  # one column takes a slow matrix-vector path: use two
    for start in range(0, len(vectors), CHUNK_ROWS):
        block = vectors[start:start + CHUNK_ROWS]
        if block.dtype == queries.dtype:
            yield start, (block @ queries.T).T
            continue
        # float16 vectors, computed in float32 a few thousand rows at a time: converted while
        # they sit in cache, 1M x 577 take 0.17 s against 0.75 s converted in one piece.
        scores = torch.empty((len(queries), len(block)))
        for sub in range(0, len(block), CONVERT_ROWS):
            part = block[sub:sub + CONVERT_ROWS].to(queries.dtype)
            scores[:, sub:sub + CONVERT_ROWS] = (part @ queries.T).T
        yield start, scores


def top_k_inner_product(vectors: torch.Tensor | PackedVectors, queries: np.ndarray,
                        k: int, bias: torch.Tensor | None = None
                        ) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of shape (n_queries, min(k, rows)), best first; ``bias`` (one value per
    row) is subtracted from every query's scores (an L2 search's half squared norms)."""
    n_queries = len(queries)
    found = min(k, len(vectors))
    if found == 0:
        return np.zeros((n_queries, 0), np.float32), np.zeros((n_queries, 0), np.int64)
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    blocks = (vectors.scores(q) if isinstance(vectors, PackedVectors)
              else _plain_scores(vectors, q))
    best_scores, best_ids = [], []
    with torch.no_grad():
        for start, scores in blocks:
            if bias is not None:
                scores = scores - bias[start:start + scores.shape[1]]
            top = torch.topk(scores, min(found, scores.shape[1]), dim=1)
            best_scores.append(top.values)
            best_ids.append(top.indices + start)
        scores, ids = torch.cat(best_scores, dim=1), torch.cat(best_ids, dim=1)
        if len(best_scores) > 1:
            top = torch.topk(scores, found, dim=1)
            scores, ids = top.values, ids.gather(1, top.indices)
    return (np.ascontiguousarray(scores[:n_queries].numpy()),
            np.ascontiguousarray(ids[:n_queries].numpy(), dtype=np.int64))
