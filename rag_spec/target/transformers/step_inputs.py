"""The inputs of one forward pass over a ``TreeKVCache``: each row's tokens, their position ids
and what each may attend to (a compact ``TreeMask`` for full attention, a dense additive mask
where layers slide). Built here, run by the runner (``runner``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rag_spec.target.transformers.kv_cache import SlidingWindow
from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec.target.tree import TokenTree
from rag_spec_kernels import SparseView, TreeMask


@dataclass(frozen=True)
class TreeBatch:
    """One forward pass over a root token plus a tree per row (or a draft pass of a round)."""

    input_ids: torch.Tensor  # [B, N] root token, then the tree's tokens, then padding
    position_ids: torch.Tensor  # [B, N] committed length + depth
    # full attention: the compact mask (committed bits, the round's bits per token)
    mask: TreeMask | None
    # sliding-window models: [B, 1, N, cache_len + N] additive float mask, or one per layer
    # kind where only some layers slide (``dense_mask``)
    attention_mask: torch.Tensor | dict[str, torch.Tensor] | None = None


def tree_step(cache: TreeKVCache, trees: Sequence[TokenTree], dtype: torch.dtype) -> TreeBatch:
    """Inputs for verifying ``trees`` (one per row, empty for none) below each root. Built in
    numpy: a step's own work is a few microseconds, not dozens of tensor operators (on a GPU,
    whose steps are short, that is a visible share of each)."""
    batch = len(trees)
    width = 1 + max(len(t) for t in trees)
    input_ids = np.zeros((batch, width), dtype=np.int64)
    position_ids = np.zeros((batch, width), dtype=np.int64)
    local = np.zeros((batch, width, width), dtype=bool)
    local[:, np.arange(width), np.arange(width)] = True  # padding sees itself
    for b, (tree, root, pos) in enumerate(zip(trees, cache.roots, cache.positions)):
        n = len(tree)
        input_ids[b, 0] = root
        input_ids[b, 1:1 + n] = tree.tokens
        position_ids[b, 0] = pos
        position_ids[b, 1:1 + n] = pos + tree.depths
        local[b, 1:1 + n, 0] = True  # every node sees the root
        local[b, 1:1 + n, 1:1 + n] = tree.ancestor_mask
    return round_step(cache, torch.from_numpy(input_ids), torch.from_numpy(position_ids),
                      torch.from_numpy(local), dtype)


def round_step(cache: TreeKVCache, input_ids: torch.Tensor, position_ids: torch.Tensor,
               sees: torch.Tensor, dtype: torch.dtype, sparse: SparseView | None = None
               ) -> TreeBatch:
    """Inputs for one more pass of the current round: ``W`` uncommitted tokens per row that see
    every committed slot plus what ``sees`` marks.

    A round is every pass since the last ``keep`` (a verification step is one pass; a draft
    model's round is one pass per tree depth); its slots follow the committed ones, in the
    order the passes wrote them.

    Args:
        cache: the cache the pass reads and writes (its round grows by ``W`` slots).
        input_ids: [B, W] tokens (padding where a row has fewer).
        position_ids: [B, W] their position ids.
        sees: [B, W, round + W] bool, which of the round's slots (those written by earlier
            passes, then this pass's tokens) each token attends to.
        dtype: the model's dtype (of a dense mask).
        sparse: the only committed slots to attend to (e.g. ``SinkWindow``'s view); None: all
            of them. Full-attention models only.
    """
    device = cache.valid.device
    batch, width = input_ids.shape
    position_ids = position_ids.to(device)
    sees = sees.to(device)
    cache.write_round(position_ids)
    if cache.window is None:
        committed = cache.valid if sparse is None else sparse.committed(cache.valid)
        return TreeBatch(input_ids.to(device), position_ids, TreeMask(committed, sees, sparse))
    if sparse is not None:
        msg = "A sparse view of the cache needs a full-attention model (this one slides)."
        raise ValueError(msg)
    prefix = cache.valid[:, None, :].expand(batch, width, cache.length)
    allowed = torch.cat([prefix, sees], dim=-1)
    kv_positions = torch.cat([cache.slot_positions(), cache.round_positions], dim=1)
    return TreeBatch(input_ids.to(device), position_ids, None,
                     dense_mask(cache.window, allowed, position_ids, kv_positions, dtype))


def dense_mask(window: SlidingWindow | None, allowed: torch.Tensor,
               query_positions: torch.Tensor, key_positions: torch.Tensor, dtype: torch.dtype
               ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The additive ``attention_mask`` of a pass whose queries see the keys ``allowed``
    ([B, q, kv]), within the sliding ``window`` where layers slide (a key's position greater
    than the query's minus the window, transformers' rule): one mask where every layer attends
    alike, else one per layer kind, which transformers' models take as such."""
    if window is None:
        return additive(allowed, dtype)
    windowed = allowed & (key_positions[:, None, :] > query_positions[:, :, None] - window.size)
    if not window.mixed:
        return additive(windowed, dtype)
    return {"full_attention": additive(allowed, dtype),
            "sliding_attention": additive(windowed, dtype)}


def additive(allowed: torch.Tensor, dtype: torch.dtype, slots: int | None = None
             ) -> torch.Tensor:
    """[B, q, kv] bool -> [B, 1, q, slots] additive float mask (0 or the dtype's minimum; the
    slots after ``kv``, if ``slots`` is more, masked)."""
    batch, queries, keys = allowed.shape
    mask = torch.full((batch, 1, queries, slots or keys), torch.finfo(dtype).min, dtype=dtype,
                      device=allowed.device)
    mask[:, 0, :, :keys].masked_fill_(allowed, 0.0)
    return mask
