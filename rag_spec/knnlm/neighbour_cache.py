"""Speculative kNN-LM's cache: the entries around the neighbours verified so far.

The datastore is in corpus order, so the entries just after a verified neighbour are the
continuation of its text: when generation follows that text, the next steps' neighbours are
among them. A guess is the cache's ``k`` nearest, under the distances the datastore computes
(its keys, or its IVF-PQ reconstructions).
"""

from __future__ import annotations

import numpy as np

from rag_spec.knnlm.datastore import KNNDatastore


class NeighbourCache:
    """At most ``capacity`` datastore entries (the oldest leave first)."""

    def __init__(self, datastore: KNNDatastore, capacity: int, successors: int) -> None:
        self.datastore = datastore
        self.successors = successors
        self.vectors = np.zeros((capacity, datastore.dim), dtype=np.float32)
        self.squared_norms = np.zeros(capacity, dtype=np.float32)
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
        vectors = self.datastore.vectors(np.asarray(new))
        for entry, vector in zip(new, vectors):
            row = self.next_row
            if self.ids[row] >= 0:
                del self.slots[int(self.ids[row])]
            self.ids[row], self.vectors[row] = entry, vector
            self.squared_norms[row] = float(vector @ vector)
            self.slots[entry] = row
            self.next_row = (row + 1) % len(self.ids)
            self.count = min(self.count + 1, len(self.ids))

    def search(self, key: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(squared distances, entry ids) of the cached entries nearest ``key``, nearest first."""
        vectors = self.vectors[: self.count]
        distances = self.squared_norms[: self.count] - 2 * (vectors @ key) + float(key @ key)
        nearest = np.argsort(distances, kind="stable")[:k]
        return np.maximum(distances[nearest], 0), self.ids[nearest]
