"""Few-row products over weights kept in quantised blocks (a GGUF file's Q4_0, Q4_1, Q8_0), for
one-token and tree steps alike (AVX-512 or AVX2 CPUs).

A quantised weight is read at a quarter to a sixth of float32's bytes, which is what bounds a
CPU's one-token step. The kernel (``quantized_linear.cpp``) quantises each row's inputs to 8 bits
per group of 32, as llama.cpp does for these formats, and multiplies as integers; it loads each
block of weights once for up to four rows (eight with AVX-512 VNNI), so a verified tree costs
its rows' arithmetic, not another read of the weight: what speculation needs of a quantised
model, and what llama.cpp's dot products, one row and one output at a time, do not give. Each
row's output is computed in one fixed order, the same whatever rows are beside it (and whatever
instructions the build uses; ``quantized_reference`` is the product it computes, in float64).

``GroupQuantized`` is the one form every file format is converted to (``rag_spec.target.gguf``
converts GGUF's blocks): per output, integer values with a scale, and a minimum, per 32 inputs
(per 16 for Q6_K's); scales in half precision as the legacy formats store them, or in single
precision where they are products of two stored numbers (the K-quants').
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from rag_spec_kernels.cpu_extension import cpu_extension, vector_isa

GROUP = 32  # inputs per scale (GGUF's block formats but Q6_K, whose groups are of 16)
_BLOCK = 8  # outputs per packed block: one 32-bit lane each
log = logging.getLogger(__name__)

torch.library.define("rag_spec_cpu::quantized_linear",  # its CPU kernel: quantized_linear.cpp
                     "(Tensor x, Tensor values, Tensor scales, Tensor mins) -> Tensor")


@torch.library.register_fake("rag_spec_cpu::quantized_linear")
def _product_shape(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], values.shape[0] * _BLOCK)


@dataclass(frozen=True)
class GroupQuantized:
    """A (out, in) weight as integers with a scale, and a minimum, per ``group`` inputs of an
    output: ``weight[o, k] = values[o, k] * scales[o, k // group] + mins[o, k // group]``,
    rounded once."""

    values: torch.Tensor  # (out, in): uint8 in 0..15 (bits 4) or int8 (bits 8)
    scales: torch.Tensor  # (out, in // group) float16 or float32
    mins: torch.Tensor | None  # like scales; None: no minimum
    bits: int  # 4 or 8
    group: int = GROUP  # 32, or 16

    def __post_init__(self) -> None:
        out, inner = self.values.shape
        group = self.group
        if (group not in (GROUP, GROUP // 2) or inner % group
                or self.scales.shape != (out, inner // group) or self.bits not in (4, 8)
                or self.scales.dtype not in (torch.float16, torch.float32)
                or self.mins is not None and self.mins.dtype != self.scales.dtype):
            msg = (f"GroupQuantized: (out, in) values with in a multiple of the group ({GROUP} "
                   f"or {GROUP // 2}), (out, in // group) float16 or float32 scales (minimums "
                   f"alike) and 4 or 8 bits; got {tuple(self.values.shape)}, "
                   f"{tuple(self.scales.shape)} {self.scales.dtype}, group {group}, "
                   f"{self.bits} bits")
            raise ValueError(msg)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def dequantized(self, arithmetic: torch.dtype = torch.float64) -> torch.Tensor:
        """The float32 weight, each value rounded once as the kernel rounds it (the product and
        the sum are exact in float64); ``arithmetic=torch.float32`` rounds twice, a few times
        faster, for a check with a tolerance."""
        out, inner = self.shape
        weight = (self.values.view(out, inner // self.group, self.group).to(arithmetic)
                  * self.scales.to(arithmetic)[..., None])  # each group's scale over its 32
        if self.mins is not None:
            weight += self.mins.to(arithmetic)[..., None]
        return weight.view(out, inner).float()

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight takes (values, scales, minimums)."""
        out, inner = self.shape
        return (out * inner * self.bits // 8 + self.scales.nbytes
                + (0 if self.mins is None else self.mins.nbytes))


def stackable(parts: list[GroupQuantized]) -> bool:
    """Whether sibling layers' weights can be multiplied as one (``stacked``): the same groups."""
    return len({part.group for part in parts}) == 1


def stacked(parts: list[GroupQuantized]) -> GroupQuantized:
    """Weights of sibling layers as one, outputs one after another; where their widths differ
    the 4-bit ones are widened to 8 bits (the values fit), and half-precision scales to single
    (exactly), so one kernel call serves them."""
    if not stackable(parts):
        msg = "stacked: the weights' groups differ; multiply them one by one"
        raise ValueError(msg)
    bits = max(part.bits for part in parts)
    dtype = torch.uint8 if bits == 4 else torch.int8
    values = torch.cat([part.values.to(dtype) for part in parts])
    precision = max((part.scales.dtype for part in parts), key=lambda d: d.itemsize)
    scales = torch.cat([part.scales.to(precision) for part in parts])
    mins = None if all(part.mins is None for part in parts) else torch.cat([
        torch.zeros_like(part.scales, dtype=precision) if part.mins is None
        else part.mins.to(precision) for part in parts])
    return GroupQuantized(values, scales, mins, bits, parts[0].group)


def pack_quantized(weight: GroupQuantized) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` in the kernel's layout: values, scales and minimums (empty: none) per block
    of 8 outputs, zero-padded to whole blocks (``quantized_linear.cpp`` describes it; the
    scales' width tells the kernel the group's)."""
    out, inner = weight.shape
    pad = -out % _BLOCK
    values = torch.nn.functional.pad(weight.values, (0, 0, 0, pad))
    nblocks = values.shape[0] // _BLOCK
    # (blocks, output, chunk, input): each output's inputs 4 by 4, and a chunk's 8 outputs side
    # by side; 4 bits: a chunk of 8 inputs, its second four in the bytes' high halves
    values = values.view(nblocks, _BLOCK, inner // 4, 4)
    if weight.bits == 4:
        values = values.view(nblocks, _BLOCK, inner // 8, 2, 4)
        values = values[:, :, :, 0] | (values[:, :, :, 1] << 4)
    values = values.transpose(1, 2).reshape(nblocks, -1, _BLOCK * 4)

    def blocks(table: torch.Tensor) -> torch.Tensor:  # (out, groups) -> (blocks, groups, 8)
        padded = torch.nn.functional.pad(table, (0, 0, 0, pad))
        return padded.view(nblocks, _BLOCK, table.shape[1]).transpose(1, 2).contiguous()

    mins = (torch.empty(0, dtype=weight.scales.dtype) if weight.mins is None
            else blocks(weight.mins))
    return values.contiguous(), blocks(weight.scales), mins


def quantized_reference(x: torch.Tensor, weight: GroupQuantized) -> torch.Tensor:
    """The product the kernel computes, in float64: each row's inputs quantised to 8 bits per
    group of the weight's (scale: the group's largest magnitude / 127; rounded to nearest even;
    a scale too small to invert or not finite leaves the values zero), each
    group's integer dot product scaled by both scales, plus the minimums times the inputs'."""
    group = weight.group
    groups = x.float().reshape(x.shape[0], x.shape[1] // group, group)
    scale = groups.abs().amax(-1, keepdim=True) / 127
    invertible = (scale >= torch.finfo(torch.float32).tiny) & (scale < 1e37)  # else: zeros
    inverse = torch.where(invertible, 1 / scale, torch.zeros_like(scale))
    values = torch.round(groups * inverse).double()  # (rows, groups, 32)
    scale = scale.double().squeeze(-1)  # (rows, groups)
    out = weight.shape[0]
    dots = torch.einsum("rgk,ogk->rog", values, weight.values.double().view(out, -1, group))
    y = (dots * weight.scales.double() * scale[:, None]).sum(-1)
    if weight.mins is not None:
        y += (weight.mins.double() * (scale * values.sum(-1))[:, None]).sum(-1)
    return y


@functools.cache
def quantized_available() -> bool:
    """Whether quantised products can take this kernel here: a CPU with AVX-512 or AVX2, a
    build that succeeds and agrees with ``quantized_reference`` on a probe."""
    if vector_isa() is None:
        return False
    generator = torch.Generator().manual_seed(0)  # torch's global one is the caller's
    try:
        cpu_extension()
        x = torch.randn(9, 64, generator=generator)
        probes = [GroupQuantized(torch.randint(0, 16, (24, 64), generator=generator,
                                               dtype=torch.uint8),
                                 torch.rand(24, 2, generator=generator).half(),
                                 torch.randn(24, 2, generator=generator).half(), 4),
                  GroupQuantized(torch.randint(-128, 128, (24, 64), generator=generator,
                                               dtype=torch.int8),
                                 torch.rand(24, 2, generator=generator).half(), None, 8)]
        ok = all(torch.allclose(quantized_linear(x, pack_quantized(w), 24).double(),
                                quantized_reference(x, w), rtol=1e-4, atol=1e-3)
                 for w in probes)
    except Exception as error:  # noqa: BLE001 - any build failure means: float32 weights
        log.warning("rag-spec: the quantised-product kernel did not build (%s); weights are "
                    "de-quantised to float32 instead", error)
        return False
    return ok


def quantized_linear(x: torch.Tensor, packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                     out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a (rows, in) float32 ``x`` and a ``pack_quantized`` result,
    where ``quantized_available`` (which builds the kernel) said yes; traceable."""
    y = torch.ops.rag_spec_cpu.quantized_linear.default(x.contiguous(), *packed)
    if y.shape[-1] != out_features:
        y = y[:, :out_features].contiguous()
    return y if bias is None else y.add_(bias)
