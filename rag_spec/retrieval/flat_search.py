"""Exact inner-product top-k over a flat index's own vectors, with torch's matrix products.

On CPU, faiss's flat search scans the vectors once per query (393 ms for one query over
5M x 384 on 2 cores, 866 ms for eight); a matrix product reads them once per batch and runs at
memory speed (~210 ms for one to four queries). That makes a batch of queries cost little more
than one, which is what batched verification of speculated retrievals relies on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

CHUNK_ROWS = 262_144  # rows scored at a time: bounds the score buffer to CHUNK_ROWS x queries


def flat_vectors(index: Any) -> torch.Tensor:
    """The vectors a faiss flat index stores, as a (ntotal, d) tensor sharing its memory."""
    import faiss

    flat = faiss.rev_swig_ptr(index.get_xb(), index.ntotal * index.d)
    return torch.from_numpy(flat).view(index.ntotal, index.d)


def top_k_inner_product(vectors: torch.Tensor, queries: np.ndarray,
                        k: int) -> tuple[np.ndarray, np.ndarray]:
    """(scores, ids) of shape (n_queries, min(k, rows)), best first."""
    n_queries = len(queries)
    found = min(k, len(vectors))
    if found == 0:
        return np.zeros((n_queries, 0), np.float32), np.zeros((n_queries, 0), np.int64)
    q = torch.from_numpy(np.ascontiguousarray(queries, dtype=np.float32))
    if n_queries == 1:
        q = q.repeat(2, 1)  # a one-column product takes a slow matrix-vector path: use two
    best_scores, best_ids = [], []
    with torch.no_grad():
        for start in range(0, len(vectors), CHUNK_ROWS):
            scores = vectors[start:start + CHUNK_ROWS] @ q.T  # (rows, queries)
            top = torch.topk(scores, min(found, len(scores)), dim=0)
            best_scores.append(top.values)
            best_ids.append(top.indices + start)
        scores, ids = torch.cat(best_scores), torch.cat(best_ids)
        if len(best_scores) > 1:
            top = torch.topk(scores, found, dim=0)
            scores, ids = top.values, ids.gather(0, top.indices)
    return (np.ascontiguousarray(scores.T[:n_queries].numpy()),
            np.ascontiguousarray(ids.T[:n_queries].numpy(), dtype=np.int64))
