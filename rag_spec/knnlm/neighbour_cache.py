"""Speculative kNN-LM's cache: the entries around the neighbours verified so far.

The datastore is in corpus order, so the entries just after a verified neighbour are the
continuation of its text: when generation follows that text, the next steps' neighbours are
among them. A guess is the cache's ``k`` nearest, under the distances the datastore computes
(its keys, or its IVF-PQ reconstructions).
"""

from __future__ import annotations

import numpy as np
import torch

from rag_spec.knnlm.datastore import KNNDatastore


class NeighbourCache:
    """At most ``capacity`` datastore entries (the oldest leave first).

    Its arithmetic is torch's, not numpy's: numpy's BLAS keeps a thread pool of its own that
    spins beside torch's OpenMP team and slowed every decoding step 2-3x on two cores."""

    def __init__(self, datastore: KNNDatastore, capacity: int, successors: int) -> None:
        self.datastore = datastore
        self.successors = successors
        self.vectors = torch.zeros((capacity, datastore.dim))
        self.squared_norms = torch.zeros(capacity)
        self.ids = np.full(capacity, -1, dtype=np.int64)
        self.slots: dict[int, int] = {}  # entry id -> row
        self.count = 0
        self.next_row = 0  # where the next entry goes (a ring)

    def __len__(self) -> int:
        return self.count

    def add(self, neighbour_ids: np.ndarray) -> None:
        """Cache verified neighbours and the ``successors`` entries after each."""
        offsets = np.arange(self.successors + 1)
        candidates = (np.asarray(neighbour_ids).reshape(-1, 1) + offsets).ravel()
        candidates = candidates[(candidates >= 0) & (candidates < len(self.datastore))]
        new = [int(i) for i in dict.fromkeys(candidates.tolist()) if i not in self.slots]
        new = new[-len(self.ids):]
        if not new:
            return
        vectors = torch.from_numpy(self.datastore.vectors(np.asarray(new)))
        rows = (self.next_row + np.arange(len(new))) % len(self.ids)
        for entry, row in zip(new, rows.tolist()):
            if self.ids[row] >= 0:
                del self.slots[int(self.ids[row])]
            self.slots[entry] = row
        self.ids[rows] = new
        index = torch.from_numpy(rows)
        self.vectors[index] = vectors
        self.squared_norms[index] = vectors.pow(2).sum(1)
        self.next_row = int(rows[-1] + 1) % len(self.ids)
        self.count = min(self.count + len(new), len(self.ids))

    def search(self, key: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances, entry ids) of the cached entries nearest ``key``, nearest first."""
        query = torch.from_numpy(key)
        distances = (self.squared_norms[: self.count] - 2 * (self.vectors[: self.count] @ query)
                     + query @ query)
        nearest = torch.topk(distances, min(k, self.count), largest=False, sorted=True).indices
        return (distances[nearest].clamp_min(0).numpy(),
                self.ids[nearest.numpy()])
