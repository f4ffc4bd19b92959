"""``TreeMask`` attention as one C++ kernel (``tree_attention.cpp``): the CPU path of
``tree_attention`` for float32 on AVX-512 CPUs, the Triton kernel's twin. And attention that
computes each query row from its own visible keys alone (``row_attention``, AVX2 or AVX-512):
what steps on 8-bit inputs need, whose tree rows must equal one-token steps bit for bit.

At long context a step's attention reads the whole KV cache for a few query rows, and SDPA's
CPU flash kernel takes two to three times as long as that read (at batch 16 x 4k on the default
model, most of a step). This kernel passes each KV head's keys once, 32 at a time, for
every query row sharing it, with an online softmax; selected slots (a sparse view) are read in
place, so no buffer is gathered. Same contract as ``reference_attention``; tested against it.

A compiled step's attention takes a dense mask over its static cache's slots, which
``cpu_masked_attention`` hands the same kernel as bits: the slots every query sees as committed
ones, the rest as each query's own. The kernel is an operator,
``torch.ops.rag_spec_cpu.tree_attention``, that such steps call from inductor's code.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

import torch

from rag_spec_kernels.cpu_extension import cpu_extension, vector_isa
from rag_spec_kernels.mask import TreeMask

log = logging.getLogger(__name__)
_NO_SELECT = torch.empty(0, dtype=torch.int64)  # the kernel's "read slots 0..K-1"

torch.library.define("rag_spec_cpu::tree_attention",  # its CPU kernel: tree_attention.cpp
                     "(Tensor query, Tensor key, Tensor value, Tensor committed, Tensor recent, "
                     "Tensor select, float scale) -> Tensor")
torch.library.define("rag_spec_cpu::row_attention",  # its CPU kernel: row_attention.cpp
                     "(Tensor query, Tensor key, Tensor value, Tensor allowed, float scale) "
                     "-> Tensor")


@torch.library.register_fake("rag_spec_cpu::tree_attention")
def _attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     committed: torch.Tensor, recent: torch.Tensor, select: torch.Tensor,
                     scale: float) -> torch.Tensor:
    batch, heads, queries, dim = query.shape
    return query.new_empty(batch, queries, heads, dim)


@torch.library.register_fake("rag_spec_cpu::row_attention")
def _row_attention_shape(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         allowed: torch.Tensor, scale: float) -> torch.Tensor:
    batch, heads, queries, dim = query.shape
    return query.new_empty(batch, queries, heads, dim)


def cpu_attention_fits(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors: float32 on the CPU, a head dimension that is a
    multiple of 16 up to 128, and it is available here."""
    dim = query.shape[-1]
    return (query.device.type == "cpu" and query.dtype == key.dtype == torch.float32
            and dim % 16 == 0 and dim <= 128 and _available())


@torch.compiler.assume_constant_result
def _available() -> bool:
    """``cpu_attention_available``, which a compiled step asks while it is traced: a constant
    there, probed before (not traced into; a package's digest probes it before export)."""
    return cpu_attention_available()


@functools.cache
def cpu_attention_available() -> bool:
    """An AVX-512 CPU, a build that succeeds, and agreement with the reference on a probe."""
    return vector_isa() == "AVX512" and _agrees(cpu_tree_attention, "CPU attention kernel",
                                                "SDPA runs instead")


def _agrees(attend: Callable[..., torch.Tensor], kernel: str, otherwise: str) -> bool:
    """Whether the kernels build and ``attend`` (``cpu_tree_attention``'s arguments) agrees
    with ``reference_attention`` on a probe; a failure is logged as ``kernel`` did not build,
    ``otherwise``."""
    from rag_spec_kernels.mask import reference_attention

    generator = torch.Generator().manual_seed(0)  # torch's global one is the caller's
    query, key, value = (torch.randn(2, 4, 3, 32, generator=generator),
                         torch.randn(2, 2, 40, 32, generator=generator),
                         torch.randn(2, 2, 40, 32, generator=generator))
    mask = TreeMask(torch.rand(2, 37, generator=generator) > 0.3,
                    torch.tril(torch.ones(3, 3, dtype=torch.bool)).expand(2, 3, 3))
    try:
        cpu_extension()  # builds the kernels: the operators' implementations
        return torch.allclose(attend(query, key, value, mask),
                              reference_attention(query, key, value, mask), atol=1e-5)
    except Exception as error:  # noqa: BLE001 - any build failure means: the other path
        log.warning("rag-spec: the %s did not build (%s); %s", kernel, error, otherwise)
        return False


def cpu_tree_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       mask: TreeMask, scaling: float | None = None, layer: Any = None
                       ) -> torch.Tensor:
    """``reference_attention``'s contract: [B, heads, q, D] queries over [B, kv_heads, S + R,
    D] keys and values; returns [B, heads, q, D] (a view of [B, q, heads, D], the layout
    attention modules hand on). ``layer`` is not needed: selected slots are read in place."""
    committed, recent, select = mask.bits(query.device)
    return _attend(query, key, value, committed, recent,
                   select if select is not None else _NO_SELECT, scaling)


def cpu_masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         allowed: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """[B, heads, q, D] queries over [B, kv_heads, kv, D] keys and values where ``allowed``
    ([B, q, kv] bool) says which keys each query sees; returns [B, heads, q, D] as
    ``cpu_tree_attention``. The keys every query of a row sees go to the kernel as committed
    slots (read in slices, on every core), the others as each query's round slots."""
    shared = allowed.all(1)
    own = allowed & ~shared[:, None]
    return _attend(query, key, value, shared.to(torch.uint8), own.to(torch.uint8),
                   _NO_SELECT, scaling)


def _attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            committed: torch.Tensor, recent: torch.Tensor, select: torch.Tensor,
            scaling: float | None) -> torch.Tensor:
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.ops.rag_spec_cpu.tree_attention.default(
        query, key, value, committed, recent, select,
        scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2)



def row_attention_fits(query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether ``row_attention`` takes these tensors: float32 on the CPU, a head dimension that
    is a multiple of 8 up to 128, and it is available here."""
    dim = query.shape[-1]
    return (query.device.type == "cpu" and query.dtype == key.dtype == torch.float32
            and dim % 8 == 0 and dim <= 128 and _rows_available())


@torch.compiler.assume_constant_result
def _rows_available() -> bool:
    """``row_attention_available`` as a constant while a step is traced (see ``_available``)."""
    return row_attention_available()


@functools.cache
def row_attention_available() -> bool:
    """An AVX2 or AVX-512 CPU, a build that succeeds, and agreement with the reference on a
    probe."""
    return vector_isa() is not None and _agrees(
        lambda query, key, value, mask: row_attention(
            query, key, value, mask.over_cache(key.shape[2] - mask.round_length)),
        "row attention kernel", "8-bit input products are not used")


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  allowed: torch.Tensor, scaling: float | None = None) -> torch.Tensor:
    """[B, heads, q, D] queries over [B, kv_heads, kv, D] keys and values where ``allowed``
    ([B, q, kv] bool) says which keys each query sees, each query row computed from its own
    keys alone in their order (``row_attention.cpp``); returns [B, heads, q, D] as
    ``cpu_tree_attention``. Traceable."""
    query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
    out = torch.ops.rag_spec_cpu.row_attention.default(
        query, key, value, allowed.to(torch.uint8).contiguous(),
        scaling if scaling is not None else query.shape[-1] ** -0.5)
    return out.transpose(1, 2)
