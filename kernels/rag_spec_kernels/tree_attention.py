"""Grouped-query attention for a step of query tokens (a token tree, a chain, one token) over a
KV cache, reading each KV head once, with the step's mask given compactly.

transformers' SDPA path repeats every KV head for each of its query heads (``repeat_kv``) as
soon as a step has more than one query token and a mask: a copy of the whole KV cache per layer
per step. Here the query heads that share a KV head are stacked along the query axis instead,
so one pass per KV head covers every query head and every step token.

The mask (``TreeMask``) is what a speculative step needs and no more: which committed slots of
each row hold tokens (one bit per slot, shared by all the row's queries), and which of the
round's newest slots (the step's own tokens, and earlier draft passes of the round) each query
sees. Optionally, ``select`` names the only committed slots to read: a sparse view such as
StreamingLLM's attention sinks plus a recent window, gathered from the same cache.

One contract, two implementations: ``reference_attention`` (torch; the CPU path, on SDPA's
flash kernel) and ``triton_tree_attention`` (the GPU kernel, tested against the reference under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

TREE_ATTENTION = "rag_spec_tree"


@dataclass
class TreeMask:
    """Which keys each query token of one forward pass attends to.

    The pass's keys are ``S`` committed slots followed by ``R`` round slots (the last ``q`` of
    them the pass's own tokens). Every query sees the committed slots marked in ``committed``
    (or, with ``select``, only the selected ones that are marked) and the round slots marked in
    its row of ``recent``.

    Args:
        committed: [B, S] bool, or [B, K] with ``select``: which (selected) slots hold tokens.
        recent: [B, q, R] bool, which round slots each query token sees.
        select: [B, K] long, the committed slots to read (None: all ``S``).
    """

    committed: torch.Tensor
    recent: torch.Tensor
    select: torch.Tensor | None = None
    _dense: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = field(default_factory=dict,
                                                                repr=False, compare=False)

    @property
    def round_length(self) -> int:
        return self.recent.shape[-1]

    def bias(self, groups: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[B, 1, groups * q, K + R] additive mask over the keys actually read (selected
        committed slots, then the round), for queries stacked ``groups`` heads deep; built
        once per pass, shared by its layers."""
        key = (groups, dtype, device)
        if key not in self._dense:
            batch, q_len, _ = self.recent.shape
            committed = self.committed.to(device)[:, None, :].expand(batch, q_len, -1)
            allowed = torch.cat([committed, self.recent.to(device)], dim=-1)
            allowed = allowed[:, None].expand(-1, groups, -1, -1).reshape(
                batch, 1, groups * q_len, allowed.shape[-1])
            bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
            self._dense[key] = bias.masked_fill_(~allowed, torch.finfo(dtype).min)
        return self._dense[key]

    def over_cache(self, committed_slots: int) -> torch.Tensor:
        """[B, q, S + R] bool over every slot of the cache (selected committed bits scattered
        back to their slots): the same mask for attention that reads the whole cache."""
        committed = self.committed
        if self.select is not None:
            committed = torch.zeros(committed.shape[0], committed_slots, dtype=torch.bool,
                                    device=committed.device).scatter_(
                1, self.select.to(committed.device), self.committed)
        batch, q_len, _ = self.recent.shape
        return torch.cat([committed[:, None, :].expand(batch, q_len, -1), self.recent], dim=-1)


def gather_keys(key: torch.Tensor, value: torch.Tensor, mask: TreeMask
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values a pass reads: the selected committed slots (all of them without a
    selection), then the round's."""
    if mask.select is None:
        return key, value
    committed = key.shape[2] - mask.round_length
    index = mask.select.to(key.device)[:, None, :, None].expand(-1, key.shape[1], -1,
                                                                key.shape[3])
    return (torch.cat([key[:, :, :committed].gather(2, index), key[:, :, committed:]], dim=2),
            torch.cat([value[:, :, :committed].gather(2, index), value[:, :, committed:]], dim=2))


def reference_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        mask: TreeMask, scaling: float | None = None) -> torch.Tensor:
    """The contract in torch: [B, heads, q, D] queries over [B, kv_heads, S + R, D] keys and
    values under ``mask``; returns [B, heads, q, D].

    Query heads are stacked per KV head ([B, kv_heads, groups * q, D]) so the KV cache is read
    once per KV head; on a CPU, SDPA runs it with its flash kernel.
    """
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    key, value = gather_keys(key, value, mask)
    stacked = query.reshape(batch, kv_heads, groups * q_len, dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask.bias(groups, query.dtype, query.device),
        scale=scaling)
    return out.reshape(batch, heads, q_len, dim)


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None,
                   tree_mask: TreeMask | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface.

    Args:
        query: [B, heads, q, D]; key, value: [B, kv_heads, kv, D].
        attention_mask: [B, 1, q, kv] additive float or bool mask (None: causal); ignored when
            ``tree_mask`` is given (a speculative step's compact mask, passed as a forward
            keyword).

    Returns:
        ([B, q, heads, D], None), as every transformers attention function returns.
    """
    if tree_mask is not None:
        out = _kernel(query)(query, key, value, tree_mask, scaling)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None:  # plain causal prefill or one-token steps: the stock path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    # [B, heads, q, D] -> [B, kv_heads, groups * q, D]: heads of one group become more queries.
    stacked = query.reshape(batch, kv_heads, groups * q_len, dim)
    mask = attention_mask
    if groups > 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(
            mask.shape[0], 1, groups * q_len, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def _kernel(query: torch.Tensor) -> Any:
    """The Triton kernel on a GPU where Triton is installed; the torch reference otherwise."""
    if query.is_cuda:
        from rag_spec_kernels.triton_tree_attention import triton_available, triton_tree_attention

        if triton_available():
            return triton_tree_attention
    return reference_attention


def register_tree_attention() -> str:
    """Register ``tree_attention`` in transformers' public attention registry, with SDPA's mask
    builder for the masks a model makes itself (causal and sliding-window prefills); idempotent.
    Returns the name a config's ``_attn_implementation`` selects it by."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
    return TREE_ATTENTION
