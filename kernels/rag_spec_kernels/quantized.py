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
(per 16 for Q6_K's); scales in half precision as the legacy formats store them, or, as the
K-quants store them, small integers with a factor per 256 inputs.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from rag_spec_kernels.cpu_extension import cpu_extension, vector_isa

GROUP = 32  # inputs per scale (GGUF's block formats but Q6_K, whose groups are of 16)
SPAN = 256  # inputs per factor of integer scales (a K-quant's super-block)
_BLOCK = 8  # outputs per packed block: one 32-bit lane each
log = logging.getLogger(__name__)

torch.library.define("rag_spec_cpu::quantized_linear",  # its CPU kernel: quantized_linear.cpp
                     "(Tensor x, Tensor values, Tensor scales, Tensor mins, Tensor factors) "
                     "-> Tensor")


@torch.library.register_fake("rag_spec_cpu::quantized_linear")
def _product_shape(x: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], values.shape[0] * _BLOCK)


@dataclass(frozen=True)
class GroupQuantized:
    """A (out, in) weight as integers with a scale, and a minimum, per ``group`` inputs of an
    output: ``weight[o, k] = values[o, k] * scales[o, k // group] + mins[o, k // group]``,
    rounded once. Scales (and minimums) are half-precision numbers, or int8 ones times a
    float32 factor per ``SPAN`` inputs (``scale_factors``, ``min_factors``: (out, in // SPAN)),
    the K-quants' form, whose products are exact in float32."""

    values: torch.Tensor  # (out, in): uint8 in 0..15 (bits 4) or int8 (bits 8)
    scales: torch.Tensor  # (out, in // group) float16, or int8 with scale_factors
    mins: torch.Tensor | None  # like scales; None: no minimum
    bits: int  # 4 or 8
    group: int = GROUP  # 32, or 16
    scale_factors: torch.Tensor | None = None
    min_factors: torch.Tensor | None = None

    def __post_init__(self) -> None:
        out, inner = self.values.shape
        group, factored = self.group, self.scales.dtype == torch.int8
        spans = (out, inner // SPAN)
        if (group not in (GROUP, GROUP // 2) or inner % group
                or self.scales.shape != (out, inner // group) or self.bits not in (4, 8)
                or self.scales.dtype not in (torch.float16, torch.int8)
                or self.mins is not None and self.mins.dtype != self.scales.dtype
                or factored and (inner % SPAN or _shape(self.scale_factors) != spans
                                 or self.mins is not None
                                 and _shape(self.min_factors) != spans)
                or not factored and (self.scale_factors, self.min_factors) != (None, None)):
            msg = (f"GroupQuantized: (out, in) values with in a multiple of the group ({GROUP} "
                   f"or {GROUP // 2}), (out, in // group) float16 scales, or int8 ones with "
                   f"(out, in // {SPAN}) factors (minimums alike), and 4 or 8 bits; got "
                   f"{tuple(self.values.shape)}, {tuple(self.scales.shape)} {self.scales.dtype}, "
                   f"factors {_shape(self.scale_factors)}, group {group}, {self.bits} bits")
            raise ValueError(msg)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def scaling(self, arithmetic: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each group's scale and minimum (None: none) as numbers of ``arithmetic``: a factor
        times an integer is exact in float32."""
        def expanded(numbers: torch.Tensor, factors: torch.Tensor | None) -> torch.Tensor:
            if factors is None:
                return numbers.to(arithmetic)
            spread = factors.to(arithmetic).repeat_interleave(SPAN // self.group, dim=1)
            return numbers.to(arithmetic) * spread

        return (expanded(self.scales, self.scale_factors),
                None if self.mins is None else expanded(self.mins, self.min_factors))

    def dequantized(self, arithmetic: torch.dtype = torch.float64) -> torch.Tensor:
        """The float32 weight, each value rounded once as the kernel rounds it (the product and
        the sum are exact in float64); ``arithmetic=torch.float32`` rounds twice, a few times
        faster, for a check with a tolerance."""
        out, inner = self.shape
        scales, mins = self.scaling(arithmetic)
        weight = (self.values.view(out, inner // self.group, self.group).to(arithmetic)
                  * scales[..., None])  # each group's scale over its values
        if mins is not None:
            weight += mins[..., None]
        return weight.view(out, inner).float()

    def taken(self, rows: torch.Tensor) -> GroupQuantized:
        """The weight's outputs ``rows``, in that order."""
        def of(table: torch.Tensor | None) -> torch.Tensor | None:
            return None if table is None else table[rows]

        return GroupQuantized(self.values[rows], self.scales[rows], of(self.mins), self.bits,
                              self.group, of(self.scale_factors), of(self.min_factors))

    @property
    def nbytes(self) -> int:
        """Bytes the packed weight takes (values, scales, minimums, factors)."""
        out, inner = self.shape
        return out * inner * self.bits // 8 + sum(
            table.nbytes for table in (self.scales, self.mins, self.scale_factors,
                                       self.min_factors) if table is not None)


def _shape(table: torch.Tensor | None) -> tuple[int, ...] | None:
    return None if table is None else tuple(table.shape)


def stackable(parts: list[GroupQuantized]) -> bool:
    """Whether sibling layers' weights can be multiplied as one (``stacked``): the same groups,
    scales of one kind."""
    return len({(part.group, part.scales.dtype) for part in parts}) == 1


def stacked(parts: list[GroupQuantized]) -> GroupQuantized:
    """Weights of sibling layers as one, outputs one after another; where their widths differ
    the 4-bit ones are widened to 8 bits (the values fit), so one kernel call serves them."""
    if not stackable(parts):
        msg = ("stacked: the weights' groups, or their kinds of scales, differ; multiply them "
               "one by one")
        raise ValueError(msg)
    bits = max(part.bits for part in parts)
    dtype = torch.uint8 if bits == 4 else torch.int8
    factored = parts[0].scale_factors is not None

    def joined(field: str, like: str) -> torch.Tensor | None:  # zeros where a part has none
        tables = [getattr(part, field) for part in parts]
        if all(table is None for table in tables):
            return None
        return torch.cat([torch.zeros_like(getattr(part, like)) if table is None else table
                          for part, table in zip(parts, tables)])

    return GroupQuantized(
        torch.cat([part.values.to(dtype) for part in parts]), joined("scales", "scales"),
        joined("mins", "scales"), bits, parts[0].group,
        joined("scale_factors", "scale_factors") if factored else None,
        joined("min_factors", "scale_factors") if factored else None)


def pack_quantized(weight: GroupQuantized
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight`` in the kernel's layout: values, scales, minimums (empty: none) and the
    integer scales' factors (empty: none; scales' then minimums', side by side) per block of 8
    outputs, zero-padded to whole blocks (``quantized_linear.cpp`` describes it; the scales'
    width tells the kernel the group's)."""
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
    factors = torch.empty(0)
    if weight.scale_factors is not None:
        of_mins = (torch.zeros_like(weight.scale_factors) if weight.min_factors is None
                   else weight.min_factors)
        factors = torch.cat([blocks(weight.scale_factors), blocks(of_mins)], -1).contiguous()
    return values.contiguous(), blocks(weight.scales), mins, factors


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
    scales, mins = weight.scaling(torch.float64)
    dots = torch.einsum("rgk,ogk->rog", values, weight.values.double().view(out, -1, group))
    y = (dots * scales * scale[:, None]).sum(-1)
    if mins is not None:
        y += (mins * (scale * values.sum(-1))[:, None]).sum(-1)
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


def quantized_linear(x: torch.Tensor,
                     packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
                     out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a (rows, in) float32 ``x`` and a ``pack_quantized`` result,
    where ``quantized_available`` (which builds the kernel) said yes; traceable."""
    y = torch.ops.rag_spec_cpu.quantized_linear.default(x.contiguous(), *packed)
    if y.shape[-1] != out_features:
        y = y[:, :out_features].contiguous()
    return y if bias is None else y.add_(bias)
