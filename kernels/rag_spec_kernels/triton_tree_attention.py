"""``TreeMask`` attention as one Triton kernel (the GPU path of ``tree_attention``).

One program per (row, KV head, block of stacked queries): the query heads sharing a KV head are
stacked (``groups * q`` rows), so each key and value block is loaded once for all of them. It
streams the committed slots (through ``select`` where a sparse view names them), then the
round's slots, with an online softmax (flash-decoding style, no score matrix in memory); the
mask is read as one bit per committed slot and per (query token, round slot).

Same contract as ``reference_attention``; tested against it on the CPU under
``TRITON_INTERPRET=1``. fp32 products use IEEE precision (no TF32), so fp32 results match the
reference to 1e-5.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from rag_spec_kernels.mask import TreeMask

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU path needs none of this
    triton = None


# Triton's interpreter (3.9) misreads 16-bit operands of tl.dot; there they are upcast first.
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def triton_available() -> bool:
    """Whether Triton is installed (the kernel needs it; the torch reference does not)."""
    return triton is not None


if triton is not None:  # the JIT functions must be module globals

    @triton.jit
    def _attend(q, k, v, allowed, m_i, l_i, acc, scale, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr):
        if UPCAST:
            q, k, v = q.to(tl.float32), k.to(tl.float32), v.to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(scores - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l_i, acc

    @triton.jit
    def _tree_attention(Q, K, V, Out, Committed, Recent, Select,
               s_qb, s_qh, s_qm, s_kb, s_kh, s_kn, s_vb, s_vh, s_vn, s_ob, s_oh, s_om,
               s_cb, s_rb, s_rq, s_sb,
               n_committed, round_start, n_round, q_len, rows, dim, scale,
               HAS_SELECT: tl.constexpr, PRECISION: tl.constexpr,
               UPCAST: tl.constexpr, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        b = tl.program_id(0)
        h = tl.program_id(1)
        m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_ok = m < rows
        d_ok = d < dim
        token = m % q_len  # stacked row -> the query token it belongs to
        q = tl.load(Q + b * s_qb + h * s_qh + m[:, None] * s_qm + d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        k_base = K + b * s_kb + h * s_kh
        v_base = V + b * s_vb + h * s_vh
        for start in range(0, n_committed, BLOCK_N):  # committed slots: one bit each
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < n_committed
            if HAS_SELECT:  # noqa: SIM108 (a compile-time branch)
                slot = tl.load(Select + b * s_sb + n, mask=n_ok, other=0)
            else:
                slot = n
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_base + slot[:, None] * s_kn + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + slot[:, None] * s_vn + d[None, :], mask=kv_ok, other=0.0)
            bits = tl.load(Committed + b * s_cb + n, mask=n_ok, other=0) != 0
            allowed = m_ok[:, None] & bits[None, :]
            m_i, l_i, acc = _attend(q, k, v, allowed, m_i, l_i, acc, scale, PRECISION, UPCAST)
        for start in range(0, n_round, BLOCK_N):  # the round's slots: bits per query token
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < n_round
            kv_ok = n_ok[:, None] & d_ok[None, :]
            slot = round_start + n
            k = tl.load(k_base + slot[:, None] * s_kn + d[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_base + slot[:, None] * s_vn + d[None, :], mask=kv_ok, other=0.0)
            bits = tl.load(Recent + b * s_rb + token[:, None] * s_rq + n[None, :],
                           mask=m_ok[:, None] & n_ok[None, :], other=0) != 0
            m_i, l_i, acc = _attend(q, k, v, bits, m_i, l_i, acc, scale, PRECISION, UPCAST)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(Out + b * s_ob + h * s_oh + m[:, None] * s_om + d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def triton_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          mask: TreeMask, scaling: float | None = None, layer: Any = None
                          ) -> torch.Tensor:
    """``reference_attention``'s contract on the Triton kernel: [B, heads, q, D] queries over
    [B, kv_heads, S + R, D] keys and values; returns [B, heads, q, D]. Selected slots are read
    in place, so ``layer`` (which names the reference's buffers) is not needed."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    rows = groups * q_len
    stacked = _unit_stride(query.reshape(batch, kv_heads, rows, dim))
    key, value = _unit_stride(key), _unit_stride(value)
    out = torch.empty(batch, kv_heads, rows, dim, dtype=query.dtype, device=query.device)
    committed, recent, select = mask.bits(query.device)
    select = select if select is not None else committed  # not read without a selection
    block_m = min(64, max(16, triton.next_power_of_2(rows)))
    grid = (batch, kv_heads, triton.cdiv(rows, block_m))
    _tree_attention[grid](
        stacked, key, value, out, committed, recent, select,
        stacked.stride(0), stacked.stride(1), stacked.stride(2),
        key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        committed.stride(0), recent.stride(0), recent.stride(1), select.stride(0),
        committed.shape[1], key.shape[2] - mask.round_length, mask.round_length, q_len, rows,
        dim, scaling if scaling is not None else dim ** -0.5,
        HAS_SELECT=mask.select is not None,
        PRECISION="ieee" if query.dtype == torch.float32 or _INTERPRETED else "tf32",
        UPCAST=_INTERPRETED and query.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=max(16, triton.next_power_of_2(dim)))
    return out.reshape(batch, heads, q_len, dim)


def _unit_stride(tensor: torch.Tensor) -> torch.Tensor:
    """The kernel indexes the head dimension with stride 1 (cache slabs already have it)."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()
