"""Exact numerics: every token of a multi-token step computed bit for bit as a one-token step.

A verification step computes many tokens at once. Its outputs equal a one-token step's only up
to rounding: matrix kernels pick their blocking by the number of rows, and attention over a
tree mask sums over keys in another order than attention over a plain prefix. In float32 that
rounding has not changed a greedy token in any of our tests; in bfloat16 a logit has 8 bits of
mantissa, exact ties between the top two tokens are common, and the smallest rounding
difference changes the output. So for half precision the decoder can run exactly:

- ``exact_tree_attention``: each query token attends through transformers' own SDPA call for a
  one-token step, over exactly the keys it sees, in sequence order (a prefix view where they
  are one, a gathered copy otherwise);
- ``RowChunkedLinear``: a linear layer fed more than one row multiplies them in chunks of a
  row count its kernel was measured to compute row by row identically (``invariant_rows``),
  padded to that count; except under ``whole_rows()``, for a prompt's prefill,
  which multiplies all its rows at once as ``generate``'s prefill does.

Every other operator of a decoder layer (norms, rotary embeddings, activations) is per row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch

from rag_spec_kernels.mask import (
    VisibleKeys,
    gather_keys,
    pass_mask,
    seen_keys,
)

EXACT_TREE_ATTENTION = "rag_spec_tree_exact"
_MOST_ROWS = 32  # row counts up to this are probed
_WHOLE = ContextVar("rag_spec_whole_rows", default=False)


def exact_tree_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                         value: torch.Tensor, attention_mask: torch.Tensor | None,
                         dropout: float = 0.0, scaling: float | None = None, **kwargs: Any
                         ) -> tuple[torch.Tensor, None]:
    """transformers attention interface, as ``tree_attention`` takes it; [B, q, heads, D].

    A prefill (no mask) runs the stock causal path, as ``generate``'s prefill does. Any pass
    with a mask (a tree mask, or a dense one) runs one stock one-token call per query token.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def stock(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return sdpa_attention_forward(module, q, k, v, None, dropout=dropout, scaling=scaling,
                                      **kwargs)[0]

    tree_mask = pass_mask()
    if tree_mask is None and attention_mask is None:
        return stock(query, key, value), None
    if tree_mask is not None:
        key, value = gather_keys(key, value, tree_mask, module)
        visible = tree_mask.visible(key.device)
    else:
        assert attention_mask is not None
        allowed = seen_keys(attention_mask)
        nothing = allowed.new_zeros(0)
        visible = [VisibleKeys.of(nothing, row, key.device) for row in allowed]
    rows = []
    for b, row in enumerate(visible):
        keys, values = key[b:b + 1], value[b:b + 1]
        scratch: tuple[torch.Tensor, torch.Tensor] | None = None
        outs = []
        for q, tail in zip(query[b:b + 1].split(1, dim=2), row.tails):
            if isinstance(tail, int):  # a prefix of the keys: a view
                k, v = keys[:, :, :row.offset + tail], values[:, :, :row.offset + tail]
            else:
                scratch = scratch or _with_base(keys, values, row)
                seen = row.base_length + len(tail)
                for held, source in zip(scratch, (keys, values)):
                    held[:, :, row.base_length:seen] = source.index_select(2, tail)
                k, v = scratch[0][:, :, :seen], scratch[1][:, :, :seen]
            outs.append(stock(q, k, v))  # [1, 1, heads, D]
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows), None


def _with_base(keys: torch.Tensor, values: torch.Tensor, row: VisibleKeys
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Buffers for one row's copied keys and values, holding its base keys (copied once), with
    room for the longest tail."""
    room = row.base_length + max(len(t) if isinstance(t, torch.Tensor) else t for t in row.tails)

    def held(source: torch.Tensor) -> torch.Tensor:
        buffer = source.new_empty(1, source.shape[1], room, source.shape[3])
        buffer[:, :, :row.base_length] = source[:, :, :row.offset] if row.base is None \
            else source.index_select(2, row.base)
        return buffer

    return held(keys), held(values)


def invariant_rows(linear: torch.nn.Linear) -> tuple[int, ...]:
    """The row counts (2 to 32) that ``linear``'s kernel multiplies exactly as it multiplies
    each row alone. Kernels choose their blocking by shape, not by values, so a weight of the
    layer's shape, dtype and strides stands in for its own, with inputs built to expose any
    other order of summation: small integers and a +-2**24 pair per row at random places, so
    a sum depends on which terms meet the large one (in float32, 2**24 + 1 == 2**24). Random
    inputs are not enough: where a half-precision kernel sums a wide layer in another order,
    rounding to 8 bits hides it in all but a rare output (bfloat16 products over a wide
    layer), so a few dozen random rows pass as invariant."""
    # the layer's dtype, device and strides, small integers drawn in place (no second copy)
    on_device = torch.Generator(device=linear.weight.device).manual_seed(0)
    weight = torch.empty_like(linear.weight).random_(-2, 3, generator=on_device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    bias = None if linear.bias is None else torch.zeros_like(linear.bias)
    # float16 holds no 2**24: the same ratio, scaled down
    scale = 1.0 if torch.finfo(weight.dtype).max > 2.0**30 else 2.0**-12
    x = torch.randint(-1, 2, (_MOST_ROWS, linear.in_features), generator=generator) * scale
    rows = torch.arange(_MOST_ROWS)
    plus, minus = torch.randint(linear.in_features, (2, _MOST_ROWS), generator=generator)
    x[rows, plus], x[rows, minus] = 2.0**24 * scale, -(2.0**24) * scale
    x = x.to(weight)
    with torch.inference_mode():
        alone = torch.cat([torch.nn.functional.linear(row, weight, bias) for row in x.split(1)])
        return tuple(rows for rows in range(2, _MOST_ROWS + 1) if torch.equal(
            torch.nn.functional.linear(x[:rows], weight, bias), alone[:rows]))


@contextmanager
def whole_rows() -> Iterator[None]:
    """Within this context (on this thread or task), ``RowChunkedLinear`` multiplies all rows
    at once: a prefill computed as ``generate`` computes it."""
    token = _WHOLE.set(True)
    try:
        yield
    finally:
        _WHOLE.reset(token)


class RowChunkedLinear(torch.nn.Linear):
    """A linear layer whose multi-row products run in chunks of a row count in ``counts``
    (padded up to it: the smallest that holds them all, else chunks of the largest), so each
    row comes out as it would alone; row by row where no count is invariant. It holds the
    very parameters of the layer it stands for (no copy), in that layer's place."""

    def __init__(self, linear: torch.nn.Linear, counts: tuple[int, ...]) -> None:
        torch.nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.counts = counts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        count = flat.shape[0]
        if count == 1 or count in self.counts or _WHOLE.get():
            return torch.nn.functional.linear(x, self.weight, self.bias)
        size = next((c for c in self.counts if c >= count), max(self.counts, default=1))
        padded = flat.new_zeros(-(-count // size) * size, flat.shape[1])
        padded[:count] = flat
        chunks = [torch.nn.functional.linear(chunk, self.weight, self.bias)
                  for chunk in padded.split(size)]
        return torch.cat(chunks)[:count].reshape(*x.shape[:-1], self.out_features)
