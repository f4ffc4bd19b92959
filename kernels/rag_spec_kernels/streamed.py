"""Few-row float32 products that overlap reading the weight with the arithmetic (AVX-512 or AVX2
CPUs).

oneDNN's few-row kernels compute at full speed but add that time to the weight's read instead
of hiding it behind the read. This kernel (``streamed_linear.cpp``) prefetches the weight ahead
of the arithmetic, and on AVX-512 takes the weight's blocks two at a time, so that each input
it broadcasts feeds two lines: a tree of ten tokens costs little more than one token's weight
read (docs/concepts.md, "Why the defaults"; ``python -m
lab.floor`` times it in steps). It is built for this machine on first use (``cpu_extension``);
where the CPU has neither AVX-512 nor AVX2 or the build fails, ``streamed_available`` says no
and the runner keeps oneDNN's kernels. On AVX2 CPUs oneDNN's few-row products cost more than
one row's (its blocked layout is tuned for wider batches), while this kernel's 2-8 rows cost
about one row's weight read ("Streamed products on AVX2").

The kernel is an operator, ``torch.ops.rag_spec_cpu.streamed_linear``, defined here with its
output's shape (what ``torch.compile`` traces) and implemented in C++ (once built): a compiled
step calls it from inductor's code as it calls torch's own products (a Python operator in its
place cost more a call than the product of a small layer).
"""

from __future__ import annotations

import functools
import logging

import torch

from rag_spec_kernels.cpu_extension import cpu_extension, vector_isa

_BLOCK = 16  # outputs per packed block: one cache line of float32 weights per input position
log = logging.getLogger(__name__)

torch.library.define("rag_spec_cpu::streamed_linear",  # its CPU kernel: streamed_linear.cpp
                     "(Tensor x, Tensor packed) -> Tensor")


@torch.library.register_fake("rag_spec_cpu::streamed_linear")
def _product_shape(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], packed.shape[0] * _BLOCK)


@functools.cache
def streamed_available(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` products can take this kernel here: float32, a CPU with AVX-512 or
    AVX2, a build that succeeds and agrees with the stock product on a probe."""
    if dtype != torch.float32 or vector_isa() is None:
        return False
    generator = torch.Generator().manual_seed(0)  # torch's global one is the caller's
    try:
        cpu_extension()  # builds the kernel: the operator's implementation
        x, weight = torch.randn(20, 40, generator=generator), torch.randn(24, 40,
                                                                          generator=generator)
        whole, scale = quantized(weight)
        ok = torch.allclose(streamed_linear(x, pack_streamed(weight), 24), x @ weight.T,
                            rtol=1e-4, atol=1e-4) and torch.allclose(
            streamed_linear(x, pack_streamed(weight, torch.float16), 24),
            x @ weight.half().float().T, rtol=1e-4, atol=1e-4) and torch.allclose(
            streamed_linear(x, pack_streamed(whole), 24, scale=scale),
            x @ (whole.float() * scale[:, None]).T, rtol=1e-4, atol=1e-4)
    except Exception as error:  # noqa: BLE001 - any build failure means: use oneDNN
        log.warning("rag-spec: the streamed-product kernel did not build (%s); oneDNN's "
                    "kernels run instead", error)
        return False
    return ok


def pack_streamed(weight: torch.Tensor, stored: torch.dtype | None = None) -> torch.Tensor:
    """A (out, in) weight as (blocks, in, 16) blocks of 16 outputs, zero-padded to whole blocks:
    a copy as large as the weight; ``stored=torch.float16`` keeps it in half precision (half
    the bytes each product reads; the products still add in float32). An 8-bit weight
    (``quantized``'s) is packed as it is."""
    out, inner = weight.shape
    padded = torch.nn.functional.pad(weight.detach(), (0, 0, 0, -out % _BLOCK))
    return padded.view(-1, _BLOCK, inner).transpose(1, 2).to(stored).contiguous()


def quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A (out, in) weight as 8-bit integers and a float32 scale per output (``weight`` ~
    ``integers * scale[:, None]``, each row's largest magnitude at 127): a quarter of float32's
    bytes to read, for products that need not equal float32's (a draft head's)."""
    weight = weight.detach().float()
    scale = (weight.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny)  # 0 rows
    return (weight / scale[:, None]).round_().to(torch.int8), scale


def streamed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                    bias: torch.Tensor | None = None, scale: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``x @ weight.T + bias`` for a (rows, in) float32 ``x`` and a ``pack_streamed`` result
    (float32, float16, or 8-bit with ``quantized``'s ``scale``), where ``streamed_available``
    (which builds the kernel) said yes; traceable."""
    y = torch.ops.rag_spec_cpu.streamed_linear.default(x.contiguous(), packed)
    if y.shape[-1] != out_features:
        y = y[:, :out_features].contiguous()
    if scale is not None:
        y = y.mul_(scale)
    return y if bias is None else y.add_(bias)
