"""Exact inner-product top-k over a flat index's own vectors, with torch's matrix products.

On CPU, faiss's flat search below 20 queries grows with the batch (eight queries cost about
twice one); a matrix product reads the vectors once per batch at memory speed, the same for
one to four queries. A batch of queries then costs little more than one, which is what batched
verification of speculated retrievals relies on.

Past four queries the plain product becomes compute-bound. A packed copy in oneDNN's blocked
layout (``PackedVectors``, twice the memory) keeps one to sixteen queries at about one's cost
(``rag-spec bench ralm --retriever exact --packed``).

A matrix product's rounding depends on its shape: on some CPUs (AVX2-only ones, such as AMD's
Zen 3) a query scored in a batch of nine differs in the last bits from the same query scored
alone. Speculative retrieval is lossless only if a batched verification finds what the naive
loop's one-query searches find, so the product only shortlists candidates, and their scores
are computed again in float64 with elementwise operations only, in an order the dimension fixes
(``_exact_scores``): the same bits in any batch, on any CPU. The shortlist is proven long
enough, not assumed: a row left out scores at most the shortlist's lowest product score plus
the product's rounding bound (``_product_error``, from the vectors' largest norm), and while
that could reach the k-th best exact score (many ties, e.g. keys repeated where texts start
alike) the shortlist grows fourfold and the search runs again for that query.
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
SHORTLIST_MARGIN = 16  # first shortlist: 2 k + this many (widened until proven)


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
        # they sit in cache, several times faster than converted in one piece.
        scores = torch.empty((len(queries), len(block)))
        for sub in range(0, len(block), CONVERT_ROWS):
            part = block[sub:sub + CONVERT_ROWS].to(queries.dtype)
            scores[:, sub:sub + CONVERT_ROWS] = (part @ queries.T).T
        yield start, scores


def top_k_inner_product(vectors: torch.Tensor | PackedVectors, queries: np.ndarray,
                        k: int, bias: torch.Tensor | None = None,
                        max_norm: float | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of shape (n_queries, min(k, rows)), best first, ties by id; ``bias`` (one
    value per row) is subtracted from every query's scores (an L2 search's half squared norms).
    A query's result does not depend on the other queries of the batch. ``max_norm`` bounds the
    vectors' norms (``largest_norm``; None: measured here, a pass over the vectors)."""
    n_queries = len(queries)
    found = min(k, len(vectors))
    if found == 0:
        return np.zeros((n_queries, 0), np.float32), np.zeros((n_queries, 0), np.int64)
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    raw = vectors.vectors if isinstance(vectors, PackedVectors) else vectors
    slack = _product_error(q, largest_norm(raw) if max_norm is None else max_norm, bias)
    scores = torch.empty((n_queries, found), dtype=torch.float64)
    ids = torch.empty((n_queries, found), dtype=torch.long)
    pending, size = torch.arange(n_queries), 2 * found + SHORTLIST_MARGIN
    with torch.no_grad():
        while len(pending):
            size = min(size, len(vectors))
            boundary, candidates = _shortlist(vectors, q[pending], size, bias)
            exact = _exact_scores(raw, q[pending], candidates, bias)
            order = exact.sort(dim=1, descending=True, stable=True).indices[:, :found]
            best = exact.gather(1, order)
            # a row outside the shortlist scores at most `boundary` by the product, so at most
            # `boundary + slack` exactly: below the found-th best, it cannot be among them
            proven = (boundary + slack[pending] < best[:, -1]) | (size == len(vectors))
            scores[pending[proven]] = best[proven]
            ids[pending[proven]] = candidates.gather(1, order)[proven]
            pending, size = pending[~proven], 4 * size
    return (np.ascontiguousarray(scores.float().numpy()),
            np.ascontiguousarray(ids.numpy(), dtype=np.int64))


def largest_norm(vectors: torch.Tensor) -> float:
    """An upper bound on the vectors' norms (a pass over them; callers keep it)."""
    largest = max(float(vectors[start:start + CHUNK_ROWS // 4].float().norm(dim=1).max())
                  for start in range(0, len(vectors), CHUNK_ROWS // 4))
    return norm_bound(largest, vectors.shape[1])


def norm_bound(largest: float, dim: int) -> float:
    """``largest``, a norm computed in float32 over ``dim`` terms, raised past its rounding."""
    return largest * (1 + 2 * (dim + 2) * 2.0**-24)


_RESCORED_AT_ONCE = 4_096  # candidates per query rescored in one piece


def _product_error(queries: torch.Tensor, max_norm: float, bias: torch.Tensor | None
                   ) -> torch.Tensor:
    """[n_queries] bounds on how far a float32 product's score (a d-term sum in any order, then
    less the bias) can be from the exact one: (d + 2) u (|q| |v| + |bias|), doubled for the
    roundings of the bound itself and of the float64 rescoring."""
    largest_bias = 0.0 if bias is None else float(bias.abs().max())
    return (2 * (queries.shape[1] + 2) * _unit_roundoff()
            * (queries.double().norm(dim=1) * max_norm + largest_bias))


def _unit_roundoff() -> float:
    """float32 products' unit roundoff; coarser where the process lets torch multiply float32
    in TF32 or bfloat16 (``torch.set_float32_matmul_precision``)."""
    return {"highest": 2.0**-24, "high": 2.0**-11}.get(torch.get_float32_matmul_precision(),
                                                       2.0**-8)


def _shortlist(vectors: torch.Tensor | PackedVectors, queries: torch.Tensor, size: int,
               bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's ``size`` best rows by the matrix product: ([n_queries] the lowest product
    score among them, which no row left out exceeds; [n_queries, size] their ids, ascending)."""
    n_queries = len(queries)
    blocks = (vectors.scores(queries) if isinstance(vectors, PackedVectors)
              else _plain_scores(vectors, queries))
    best_scores, best_ids = [], []
    for start, scores in blocks:
        if bias is not None:
            scores = scores - bias[start:start + scores.shape[1]]
        top = torch.topk(scores[:n_queries], min(size, scores.shape[1]), dim=1)
        best_scores.append(top.values)
        best_ids.append(top.indices + start)
    scores, ids = torch.cat(best_scores, dim=1), torch.cat(best_ids, dim=1)
    top = torch.topk(scores, size, dim=1)
    return top.values[:, -1].double(), ids.gather(1, top.indices).sort(dim=1).values


def _exact_scores(vectors: torch.Tensor, queries: torch.Tensor, ids: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """[n_queries, candidates] float64 inner products of each query with its candidates
    ``ids``, less ``bias``: float64 products (exact) summed by halving the dimension, with
    elementwise additions only, so no kernel's blocking or threading can change the order."""
    if ids.shape[1] > _RESCORED_AT_ONCE:  # a long shortlist: bounded memory
        return torch.cat([_exact_scores(vectors, queries, ids[:, start:start + _RESCORED_AT_ONCE],
                                        bias)
                          for start in range(0, ids.shape[1], _RESCORED_AT_ONCE)], dim=1)
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
    return total
