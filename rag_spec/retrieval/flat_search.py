"""Exact inner-product top-k over a flat index's own vectors, with torch's matrix products.

On CPU, faiss's flat search below 20 queries grows with the batch (over 5M x 384 on 2 cores:
393 ms for one query, 866 ms for eight); a matrix product reads the vectors once per batch at
memory speed (~230 ms for one to four queries). A batch of queries then costs little more than
one, which is what batched verification of speculated retrievals relies on.

Past four queries the plain product becomes compute-bound (~550 ms for eight). A packed copy in
oneDNN's blocked layout (``PackedVectors``, twice the memory) keeps one to sixteen queries at
~240 ms.

A matrix product's rounding depends on its shape: on some CPUs (AVX2-only ones, such as AMD's
Zen 3) a query scored in a batch of nine differs in the last bits from the same query scored
alone. Speculative retrieval is lossless only if a batched verification finds what the naive
loop's one-query searches find, so the product only shortlists candidates, and their scores
are computed again in float64 with elementwise operations only, in an order the dimension fixes
(``_exact_scores``): the same bits in any batch, on any CPU.
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
SHORTLIST_MARGIN = 16  # candidates beyond 2 k rescored: the product's rounding moves ranks by few


def flat_vectors(index: Any) -> torch.Tensor:
    """The vectors a faiss flat index stores, as a (ntotal, d) tensor sharing its memory."""
    import faiss

    flat = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)
    return torch.from_numpy(flat).view(index.ntotal, index.d)


class PackedVectors:
    """A copy of the vectors in oneDNN's blocked weight layout, chunk by chunk (~2 s per 1M x
    384 to build, as much memory again as the vectors); ``vectors`` are the originals, which
    score the shortlist."""

    def __init__(self, vectors: torch.Tensor) -> None:
        if not onednn_ops_available():
            msg = ("Packing vectors needs a torch build with oneDNN (the x86 and ARM CPU wheels "
                   "from PyPI have it); search the flat index unpacked instead.")
            raise RagSpecError(msg)
        self.vectors = vectors
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
    """(scores, ids) of shape (n_queries, min(k, rows)), best first, ties by id; ``bias`` (one
    value per row) is subtracted from every query's scores (an L2 search's half squared norms).
    A query's result does not depend on the other queries of the batch."""
    n_queries = len(queries)
    found = min(k, len(vectors))
    if found == 0:
        return np.zeros((n_queries, 0), np.float32), np.zeros((n_queries, 0), np.int64)
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    shortlist = min(2 * found + SHORTLIST_MARGIN, len(vectors))
    blocks = (vectors.scores(q) if isinstance(vectors, PackedVectors)
              else _plain_scores(vectors, q))
    best_scores, best_ids = [], []
    with torch.no_grad():
        for start, scores in blocks:
            if bias is not None:
                scores = scores - bias[start:start + scores.shape[1]]
            top = torch.topk(scores[:n_queries], min(shortlist, scores.shape[1]), dim=1)
            best_scores.append(top.values)
            best_ids.append(top.indices + start)
        scores, ids = torch.cat(best_scores, dim=1), torch.cat(best_ids, dim=1)
        if len(best_scores) > 1:
            ids = ids.gather(1, torch.topk(scores, shortlist, dim=1).indices)
        raw = vectors.vectors if isinstance(vectors, PackedVectors) else vectors
        ids = ids.sort(dim=1).values  # ties go to the lower id
        exact = _exact_scores(raw, q, ids, bias)
        order = exact.sort(dim=1, descending=True, stable=True).indices[:, :found]
        scores, ids = exact.gather(1, order), ids.gather(1, order)
    return (np.ascontiguousarray(scores.numpy()),
            np.ascontiguousarray(ids.numpy(), dtype=np.int64))


def _exact_scores(vectors: torch.Tensor, queries: torch.Tensor, ids: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """[n_queries, candidates] float32 inner products of each query with its candidates
    ``ids``, less ``bias``: float64 products (exact) summed by halving the dimension, with
    elementwise additions only, so no kernel's blocking or threading can change the order;
    then rounded once."""
    candidates = vectors[ids.reshape(-1)].reshape(*ids.shape, -1)
    terms = candidates.double() * queries.double()[:, None, :]
    while terms.shape[-1] > 1:
        half = terms.shape[-1] // 2
        folded = terms[..., :half] + terms[..., half:2 * half]
        if terms.shape[-1] % 2:
            folded[..., :1] += terms[..., -1:]
        terms = folded
    total = terms[..., 0]
    if bias is not None:
        total = total - bias[ids].double()
    return total.float()
