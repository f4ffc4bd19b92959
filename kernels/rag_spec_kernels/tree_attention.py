"""Grouped-query attention for a step of query tokens (a token tree, a chain, one token) over a
KV cache, reading each KV head once, with the step's mask given compactly.

transformers' SDPA path repeats every KV head for each of its query heads (``repeat_kv``) as
soon as a step has more than one query token and a mask: a copy of the whole KV cache per layer
per step. Here the query heads that share a KV head are stacked along the query axis instead,
so one pass per KV head covers every query head and every step token.

The mask (``TreeMask``) is what a speculative step needs and no more: which committed slots of
each row hold tokens (one bit per slot, shared by all the row's queries), and which of the
round's newest slots (the step's own tokens, and earlier draft passes of the round) each query
sees. Optionally, a ``SparseView`` names the only committed slots to read, such as StreamingLLM's
attention sinks plus a recent window, read from the same cache.

One contract, three implementations: ``reference_attention`` (torch, on SDPA's flash kernel),
``cpu_tree_attention`` (C++, the CPU path for float32 on AVX-512) and ``triton_tree_attention``
(the GPU kernel, tested against the reference under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from rag_spec_kernels.mask import TreeMask, pass_mask, reference_attention, seen_keys

TREE_ATTENTION = "rag_spec_tree"
TREE_ATTENTION_SDPA = "rag_spec_tree_sdpa"  # the same without our CPU kernel (an ablation)
TREE_ATTENTION_ROWS = "rag_spec_tree_rows"  # passes on ``row_attention``: rows as if alone
# Dense-masked passes of up to this many queries (steps, not prompts) take our CPU kernel
DENSE_KERNEL_QUERIES = 64


def tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor, attention_mask: torch.Tensor | None,
                   dropout: float = 0.0, scaling: float | None = None,
                   cpu_kernel: bool = True, rows: bool = False, **kwargs: Any
                   ) -> tuple[torch.Tensor, None]:
    """transformers attention interface.

    Args:
        query: [B, heads, q, D]; key, value: [B, kv_heads, kv, D].
        attention_mask: [B, 1, q, kv] bool mask, or additive float one of 0 or the dtype's
            minimum (rag-spec's own); None: causal. Ignored inside ``tree_pass`` (a
            speculative step's compact mask).
        cpu_kernel: on the CPU, run tree-masked steps, and dense-masked passes of up to
            ``DENSE_KERNEL_QUERIES`` queries (compiled steps), on our kernel where it fits
            (else SDPA).
        rows: on the CPU, run every pass (a tree, a chain, one token, a prompt's prefill)
            on ``row_attention`` where it fits, each query row computed from its own keys in
            their order: a token's output is bit for bit what it gets in a one-token step,
            whatever pass it came in (passes on 8-bit inputs need it, whose products amplify
            the smallest difference).

    Returns:
        ([B, q, heads, D], None), as every transformers attention function returns.
    """
    tree_mask = pass_mask()
    if rows and not query.is_cuda and dropout == 0.0:
        allowed = _row_mask(query, key, attention_mask, tree_mask)
        if allowed is not None:
            from rag_spec_kernels.cpu_attention import row_attention

            out = row_attention(query, key, value, allowed, scaling)
            return out.transpose(1, 2).contiguous(), None
    if tree_mask is not None:
        out = _kernel(query, key, cpu_kernel)(query, key, value, tree_mask, scaling,
                                                   layer=module)
        return out.transpose(1, 2).contiguous(), None
    if attention_mask is None:  # plain causal prefill or one-token steps: the stock path
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, None, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, q_len, dim = query.shape
    if cpu_kernel and dropout == 0.0 and q_len <= DENSE_KERNEL_QUERIES and not query.is_cuda:
        # a step over a static cache (compiled): ours where it fits, the mask read as bits
        from rag_spec_kernels.cpu_attention import cpu_attention_fits, cpu_masked_attention

        if cpu_attention_fits(query, key):
            allowed = seen_keys(attention_mask)[:, :, :key.shape[2]].expand(batch, -1, -1)
            out = cpu_masked_attention(query, key, value, allowed, scaling)
            return out.transpose(1, 2).contiguous(), None
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


def _row_mask(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None,
              tree_mask: TreeMask | None) -> torch.Tensor | None:
    """[B, q, kv] which keys each query of a pass sees, for ``row_attention``; None where it
    does not apply (a sparse view's draft pass, tensors it does not take)."""
    from rag_spec_kernels.cpu_attention import row_attention_fits

    batch, _, q_len, _ = query.shape
    if not row_attention_fits(query, key):
        return None
    if tree_mask is not None:
        if tree_mask.sparse is not None:
            return None
        return tree_mask.over_cache(key.shape[2] - tree_mask.round_length)
    if attention_mask is None:  # causal as SDPA's ``is_causal``: query i sees slots up to i
        # (a prompt's prefill, into a new cache or a static one's first slots), or one token
        # after all keys
        if q_len == 1:
            return torch.ones(batch, 1, key.shape[2], dtype=torch.bool, device=query.device)
        slots = torch.arange(key.shape[2], device=query.device)
        queries = torch.arange(q_len, device=query.device)
        return (slots[None, :] <= queries[:, None])[None].expand(batch, -1, -1)
    return seen_keys(attention_mask)[:, :, :key.shape[2]].expand(batch, -1, -1)


def _kernel(query: torch.Tensor, key: torch.Tensor, cpu_kernel: bool) -> Any:
    """The Triton kernel on a GPU where Triton is installed; on the CPU, ours where it fits
    (float32, AVX-512) unless ``cpu_kernel`` is off; the torch reference otherwise."""
    if query.is_cuda:
        from rag_spec_kernels.triton_tree_attention import triton_available, triton_tree_attention

        if triton_available():
            return triton_tree_attention
    elif cpu_kernel:
        from rag_spec_kernels.cpu_attention import cpu_attention_fits, cpu_tree_attention

        if cpu_attention_fits(query, key):
            return cpu_tree_attention
    return reference_attention


def register_tree_attention(exact: bool = False, cpu_kernel: bool = True, rows: bool = False
                            ) -> str:
    """Register ``tree_attention`` (``exact``: ``exact_tree_attention``; ``rows``: its passes
    on ``row_attention``; without ``cpu_kernel``: ``tree_attention`` on SDPA alone) in
    transformers' public attention registry, with SDPA's
    mask builder for the masks a model makes itself (causal and sliding-window prefills);
    idempotent. Returns the name a config's ``_attn_implementation`` selects it by."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    from rag_spec_kernels.exact import EXACT_TREE_ATTENTION, exact_tree_attention

    if exact:
        name, function = EXACT_TREE_ATTENTION, exact_tree_attention
    elif rows:
        name, function = TREE_ATTENTION_ROWS, functools.partial(tree_attention, rows=True)
    elif cpu_kernel:
        name, function = TREE_ATTENTION, tree_attention
    else:
        name, function = TREE_ATTENTION_SDPA, functools.partial(tree_attention, cpu_kernel=False)
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
