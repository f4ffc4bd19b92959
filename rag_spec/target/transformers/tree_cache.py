"""The KV cache of a batch under speculative decoding: which slots hold committed tokens, each
row's pending token and position, and compaction to accepted paths. It stores; it never runs
the model (the runner does) nor builds a pass's inputs (``step_inputs`` does).

The cache's layers are ``length`` slots long for every row. Rows accept different numbers of
tokens, so a row's slots can hold stale entries ("holes"); ``valid[b, s]`` says whether slot
``s`` of row ``b`` holds a committed token. Holes are masked out of attention and never shift
position ids, which count committed tokens only. A row's *root* is its newest committed token,
not yet in the cache: every step feeds it first, then the row's draft tree.

A cache made with a ``capacity`` holds a ``StaticCache`` instead (``compiled_step``), lent by
the runner's compiled step: its passes take a dense mask over every slot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rag_spec.target.transformers.kv_cache import (
    SlidingWindow,
    crop,
    keep_batch_rows,
    layers,
    new_cache,
)
from rag_spec_kernels import move_slots


class TreeKVCache:
    """A DynamicCache of full-length layers plus the bookkeeping that makes it a tree cache.

    Args:
        cache: the transformers cache holding ``valid.shape[1]`` slots per row.
        valid: [B, slots] bool, which slots hold committed tokens.
        roots: [B] each row's pending token.
        window: sliding attention window of the model (None: full attention).
        capacity: the slots of a static ``cache`` (None: a DynamicCache that grows).
    """

    def __init__(self, cache: Any, valid: torch.Tensor, roots: Sequence[int],
                 window: SlidingWindow | None, capacity: int | None = None) -> None:
        layers(cache)  # refuses caches whose layers evict entries
        self.cache = cache
        self.capacity = capacity
        self.valid = valid
        self.roots = list(roots)
        self.positions = valid.sum(dim=1).tolist()  # [B] position id of each root
        # [B, hidden] the target's last hidden state before each root, kept by ``keep`` after
        # passes that asked for it (``ModuleRunner.forward(features=True)``; drafters that
        # read the target's states); None until then
        self.root_features: torch.Tensor | None = None
        # [B, W, hidden] the last hidden states of the round's pass that asked for them
        self.step_features: torch.Tensor | None = None
        self.window = window
        # [B, round] position ids of the slots written since the last keep (-1: padding)
        self._round_positions = torch.zeros(valid.shape[0], 0, dtype=torch.long,
                                            device=valid.device)

    @classmethod
    def of_row(cls, cache: Any, root: int, window: SlidingWindow | None) -> TreeKVCache:
        """A view of a one-row cache a caller manages, every slot committed."""
        length = cache.get_seq_length()
        return cls(cache, torch.ones(1, length, dtype=torch.bool), [root], window)

    @property
    def length(self) -> int:
        return self.valid.shape[1]

    @property
    def round_length(self) -> int:
        """Slots written by the current round's passes so far."""
        return self._round_positions.shape[1]

    def write_round(self, position_ids: torch.Tensor) -> None:
        """The next pass writes tokens at ``position_ids`` [B, W] after the round's slots."""
        self._round_positions = torch.cat([self._round_positions, position_ids], dim=1)

    @property
    def round_positions(self) -> torch.Tensor:
        """[B, round] position ids of the slots written since the last keep (-1: padding)."""
        return self._round_positions

    def keep(self, paths: Sequence[Sequence[int]], next_roots: Sequence[int]) -> None:
        """After a step: keep each row's root and accepted path ``paths[b]`` (node indices of
        its tree), compacted to the front of the step's slots; ``next_roots`` become pending
        (and, after a pass with ``features``, the hidden states their tokens came from)."""
        if self.step_features is not None:
            last = torch.tensor([1 + path[-1] if path else 0 for path in paths],
                                device=self.step_features.device)
            rows = torch.arange(len(paths), device=last.device)
            self.root_features = self.step_features[rows, last]
            self.step_features = None
        self.keep_slots([[0] + [1 + node for node in path] for path in paths], next_roots)

    def keep_slots(self, slots: Sequence[Sequence[int]], next_roots: Sequence[int]) -> None:
        """End the round: commit ``slots[b]`` (indices into the round's slots, in sequence
        order) of each row, compacted to the front of the round; ``next_roots`` become pending.
        """
        start = self.length
        width = max(len(k) for k in slots)
        # kept slots already at the front of the round (a root alone, an accepted chain): no
        # entry moves, the round is only cut
        in_place = all(list(k) == list(range(len(k))) for k in slots)
        kept = layers(self.cache)
        if not in_place:  # every layer's keys and values [B, heads, slots, head_dim] at once
            index = torch.tensor([list(k) + [k[-1] if k else 0] * (width - len(k))
                                  for k in slots]) + start  # [B, width]
            move_slots([t for layer in kept for t in (layer.keys, layer.values)], index, start)
        if self.capacity is None:
            for layer in kept:
                layer.keys, layer.values = (layer.keys[:, :, :start + width],
                                            layer.values[:, :, :start + width])
        lengths = np.array([len(k) for k in slots])
        new_valid = torch.from_numpy(np.arange(width)[None, :] < lengths[:, None])
        self.valid = torch.cat([self.valid, new_valid.to(self.valid.device)], dim=1)
        self.positions = [p + len(k) for p, k in zip(self.positions, slots)]
        self.roots = list(next_roots)
        self._round_positions = self._round_positions[:, :0]

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Go on with only the batch rows ``rows``, in that order (the others have finished):
        passes stop reading and computing theirs. The kept rows' entries are copied once,
        with a slab layer's spare room; a round in progress is kept too."""
        index = torch.tensor(list(rows), dtype=torch.long, device=self.valid.device)
        keep_batch_rows(self.cache, index)
        self.valid = self.valid.index_select(0, index)
        self.roots = [self.roots[b] for b in rows]
        self.positions = [self.positions[b] for b in rows]
        self._round_positions = self._round_positions.index_select(0, index)
        if self.root_features is not None:
            self.root_features = self.root_features.index_select(0, index)

    def discard_round(self) -> None:
        """Drop every slot the current round wrote (a self-draft's passes, whose entries were
        computed with a sparse view and must not be kept)."""
        if self.capacity is None:
            crop(self.cache, self.length)
        self._round_positions = self._round_positions[:, :0]

    def slot_positions(self) -> torch.Tensor:
        """[B, slots] position id of each slot's token (-1 for holes and padding)."""
        positions = self.valid.long().cumsum(-1) - 1
        return positions.masked_fill(~self.valid, -1)


def joined(parts: Sequence[tuple[Any, torch.Tensor]], rows: Sequence[tuple[int, int]], *,
           release: bool = True) -> tuple[Any, torch.Tensor]:
    """One cache and its ``valid`` [B, width] from rows of others: ``rows`` names each row as
    (part, row in it) of ``parts``, (cache, valid) pairs (a static cache's slots past its
    ``valid`` are left out); each row is right-aligned, holes before it. With ``release``, the
    parts' layers are released as they are copied (they are not used after), so the join
    needs little more memory than the cache it makes."""
    width = max(parts[p][1].shape[1] for p, _ in rows)
    valid = parts[rows[0][0]][1].new_zeros(len(rows), width)
    for b, (p, r) in enumerate(rows):
        valid[b, width - parts[p][1].shape[1]:] = parts[p][1][r]
    held = [layers(cache) if mask.shape[1] else None for cache, mask in parts]  # none if empty
    cache = new_cache()
    shapes = next((h for h in held if h is not None), [])  # none: every row is empty
    for index in range(len(shapes)):
        joined = []
        for name in ("keys", "values"):
            like = getattr(shapes[index], name)
            out = like.new_zeros(len(rows), like.shape[1], width, like.shape[3])
            for b, (p, r) in enumerate(rows):
                if held[p] is not None:
                    length = parts[p][1].shape[1]
                    out[b, :, width - length:] = getattr(held[p][index], name)[r, :, :length]
            joined.append(out)
        if release:
            for h in held:
                if h is not None:
                    h[index] = None  # the part's layer list is its cache's: this frees it
        cache.update(*joined, index)
    return cache, valid
