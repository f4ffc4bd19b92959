"""Tree-step inputs for a batch, and KV-cache compaction to the accepted paths.

The cache is a transformers DynamicCache shared by the batch, ``length`` slots long. Rows
accept different numbers of tokens, so a row's slots can hold stale entries ("holes");
``valid[b, s]`` says whether slot ``s`` of row ``b`` holds a committed token. Holes are masked
out of attention and never shift position ids, which count committed tokens only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_spec.decoding.tree import TokenTree


@dataclass(frozen=True)
class TreeBatch:
    """One forward pass over a root token plus a tree per row."""

    input_ids: torch.Tensor  # [B, N] root token, then the tree's tokens, then padding
    position_ids: torch.Tensor  # [B, N] committed length + depth
    attention_mask: torch.Tensor  # [B, 1, N, cache_len + N] additive float mask


def tree_batch(roots: Sequence[int], trees: Sequence[TokenTree], positions: Sequence[int],
               valid: torch.Tensor, dtype: torch.dtype) -> TreeBatch:
    """Inputs for verifying ``trees`` (one per row) below each row's pending ``roots`` token.

    Args:
        positions: [B] position id of each root (the number of tokens already in the cache).
        valid: [B, cache_len] bool, which cache slots each row may attend to.
    """
    batch = len(trees)
    width = 1 + max(len(t) for t in trees)
    cache_len = valid.shape[1]
    device = valid.device
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    position_ids = torch.zeros(batch, width, dtype=torch.long)
    local = torch.eye(width, dtype=torch.bool).repeat(batch, 1, 1)  # padding sees itself only
    for b, (tree, root, pos) in enumerate(zip(trees, roots, positions)):
        n = len(tree)
        input_ids[b, 0] = root
        input_ids[b, 1:1 + n] = torch.tensor(tree.tokens, dtype=torch.long)
        position_ids[b, 0] = pos
        position_ids[b, 1:1 + n] = pos + torch.from_numpy(tree.depths)
        local[b, 1:1 + n, 0] = True  # every node sees the root
        local[b, 1:1 + n, 1:1 + n] = torch.from_numpy(tree.ancestor_mask)
    prefix = valid[:, None, :].expand(batch, width, cache_len).to(device)
    allowed = torch.cat([prefix, local.to(device)], dim=-1)[:, None]
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return TreeBatch(input_ids.to(device), position_ids.to(device), mask)


def keep_accepted(cache: object, start: int, keep: Sequence[Sequence[int]],
                  valid: torch.Tensor) -> torch.Tensor:
    """Compact each row's accepted slots to the front of the step's slots; return the new valid.

    Args:
        cache: DynamicCache holding ``start`` old slots plus the step's slots.
        start: cache length before the step.
        keep: per row, the step-local slot indices to keep in order (0 = the root).
        valid: [B, start] validity before the step.
    """
    width = max(len(k) for k in keep)
    index = torch.tensor([list(k) + [k[-1]] * (width - len(k)) for k in keep],
                         dtype=torch.long, device=valid.device) + start  # [B, width]
    for layer in _layers(cache):
        for name in ("keys", "values"):
            tensor = getattr(layer, name)  # [B, heads, slots, head_dim]
            gather = index[:, None, :, None].expand(-1, tensor.shape[1], -1, tensor.shape[3])
            tail = tensor.gather(2, gather)
            tensor[:, :, start:start + width] = tail
            setattr(layer, name, tensor[:, :, :start + width])
    lengths = torch.tensor([len(k) for k in keep], device=valid.device)
    new_valid = torch.arange(width, device=valid.device)[None, :] < lengths[:, None]
    return torch.cat([valid, new_valid], dim=1)


def fill_only(model: Any) -> dict[str, Any]:
    """Forward options for a pass that only fills the cache: no logits where the model can skip
    them (a prompt's logits cost 49k x 576 multiply-adds per token for the default model)."""
    return {"logits_to_keep": 1} if _skips_logits(type(model)) else {}


@functools.cache
def _skips_logits(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def fill(model: Any, cache: Any, tokens: list[int]) -> None:
    """Append ``tokens`` to a one-row ``cache`` (positions continue from its length)."""
    model(input_ids=torch.tensor([tokens], device=model.device), past_key_values=cache,
          use_cache=True, **fill_only(model))


def crop(cache: object, length: int) -> None:
    """Keep the first ``length`` positions of every layer (``DynamicCache.crop``, whose
    argument conventions changed across transformers releases)."""
    for layer in _layers(cache):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]


def _layers(cache: object) -> list:
    layers = getattr(cache, "layers", None)
    if layers is None or not all(hasattr(layer, "keys") for layer in layers):
        msg = ("rag-spec needs a transformers DynamicCache (transformers >= 5), with per-layer "
               "keys and values tensors; upgrade transformers.")
        raise TypeError(msg)
    return layers
