"""StreamingLLM's view of a KV cache, kept up to date: each row's first ``sinks`` committed
tokens (attention sinks) and its last ``window`` ones, as a ``SparseView`` of slot indices.

The window is a ring: a token committed since the last round takes the place of the oldest
one, so between rounds only the entries of new tokens change, and the view's torch buffers copy
only those (not the whole selection every round).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec_kernels import SparseView


class SinkWindow:
    """The sinks-plus-window selection of every row of ``cache``, [B, sinks + window].

    Examples:
        >>> window = SinkWindow(cache, sinks=4, window=252)            # doctest: +SKIP
        >>> round_step(cache, ids, positions, sees, dtype, window.view)  # doctest: +SKIP
        >>> window.advance(cache)  # after the target committed more  # doctest: +SKIP
    """

    def __init__(self, cache: TreeKVCache, sinks: int, window: int) -> None:
        if window < 1:
            msg = "A sink window needs window >= 1."
            raise ValueError(msg)
        self.sinks, self.window = sinks, window
        rows = cache.valid.shape[0]
        self._select = torch.zeros(rows, sinks + window, dtype=torch.long)
        self._present = torch.zeros(rows, sinks + window, dtype=torch.bool)
        self._sunk = [0] * rows  # sinks filled per row
        self._next = [0] * rows  # ring position the next window token takes
        self._synced = 0  # slots of the cache already taken in
        self._take(cache)
        self.view = SparseView(self._select.clone(), self._present.clone())

    def advance(self, cache: TreeKVCache) -> SparseView:
        """Take in the tokens committed since the last call; returns the updated view."""
        self._take(cache)
        self.view.update(self._select.clone(), self._present.clone())
        return self.view

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Only the cache's rows ``rows`` go on (``TreeKVCache.keep_rows``): a view of theirs,
        whose buffers are gathered again on the next read."""
        index = torch.tensor(list(rows), dtype=torch.long)
        self._select, self._present = self._select[index], self._present[index]
        self._sunk = [self._sunk[b] for b in rows]
        self._next = [self._next[b] for b in rows]
        self.view = SparseView(self._select.clone(), self._present.clone())

    def _take(self, cache: TreeKVCache) -> None:
        start = self._synced
        new = cache.valid[:, start:].cpu()
        for row in range(new.shape[0]):
            slots = (new[row].nonzero().flatten() + start).tolist()
            sinking = min(len(slots), self.sinks - self._sunk[row])
            for slot in slots[:sinking]:
                self._put(row, self._sunk[row], slot)
                self._sunk[row] += 1
            for slot in slots[sinking:][-self.window:]:  # older ones would be overwritten
                self._put(row, self.sinks + self._next[row], slot)
                self._next[row] = (self._next[row] + 1) % self.window
        self._synced = cache.length

    def _put(self, row: int, column: int, slot: int) -> None:
        self._select[row, column] = slot
        self._present[row, column] = True
