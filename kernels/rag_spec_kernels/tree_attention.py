"""Grouped-query attention for a tree of query tokens, reading the KV cache once.

transformers' SDPA path repeats every KV head for each of its query heads (``repeat_kv``) as
soon as a step has more than one query token and a mask: a copy of the whole KV cache per layer
per step, which is what makes multi-token verification steps expensive on a CPU. Here the query
heads that share a KV head are stacked along the query axis instead, so one SDPA call per KV
head covers every query head and every tree token, with the tree mask repeated per group.
"""

from __future__ import annotations

from typing import Any

import torch

TREE_ATTENTION = "rag_spec_tree"


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None,
                   **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers attention interface.

    Args:
        query: [B, heads, q, D]; key, value: [B, kv_heads, kv, D].
        attention_mask: [B, 1, q, kv] additive float or bool mask (None: causal).

    Returns:
        ([B, q, heads, D], None), as every transformers attention function returns.
    """
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
    if mask is not None and groups > 1:
        mask = mask[:, :, None].expand(-1, -1, groups, -1, -1).reshape(
            mask.shape[0], 1, groups * q_len, mask.shape[-1])
    out = torch.nn.functional.scaled_dot_product_attention(
        stacked, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2).contiguous(), None


def register_tree_attention() -> str:
    """Register ``tree_attention`` in transformers' public attention registry, with SDPA's mask
    builder for the masks a model makes itself (causal and sliding-window prefills); idempotent.
    Returns the name a config's ``_attn_implementation`` selects it by."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TREE_ATTENTION, tree_attention)
    AttentionMaskInterface.register(TREE_ATTENTION, sdpa_mask)
    return TREE_ATTENTION
