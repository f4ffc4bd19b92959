"""Linear layers through oneDNN on the CPU, for the few-token matrix products of verification.

The stock CPU path (``F.linear`` on BLAS) is fast for one token but slow for 2-32 (on the
machine DESIGN.md describes, a 16-token step costs 2.1x a 1-token step); oneDNN's kernels on a
blocked weight layout make the same step cost 1.6x its own 1-token step and 1.35x the stock one,
which is what lets a verified tree pay for itself. Layers that read the same input (q/k/v,
gate/up) multiply as one stacked weight: one call and one weight pass, bit-identical results.
The reordered weights are a copy, made once and kept while the layers' weights are unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

_reordered: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[Any, Any]] = (  # by first layer
    weakref.WeakKeyDictionary())
_lock = threading.Lock()
# oneDNN's inner product on a reordered weight, taking and returning dense tensors (no layout
# conversions per call), and the reorder into the blocked layout oneDNN picks for a batch size.
_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
# The batch size the weight layout is tuned for: measured here, a layout for 16 rows makes
# 1-16-row products ~30% faster than oneDNN's plain layout (it streams the weight better).
_LAYOUT_ROWS = 16


def onednn_ops_available() -> bool:
    """This torch build has oneDNN and the two operators below (the PyPI CPU wheels do)."""
    return (torch.backends.mkldnn.is_available() and _POINTWISE is not None
            and _REORDER is not None)


def onednn_available(model: Any) -> bool:
    """oneDNN applies to float32 / bfloat16 models on the CPU."""
    return (onednn_ops_available() and model.device.type == "cpu"
            and model.dtype in (torch.float32, torch.bfloat16))


def pack_weight(weight: torch.Tensor) -> Any:
    """A (out, in) weight reordered into oneDNN's blocked layout for products of 1-16 rows."""
    return _REORDER(weight, _LAYOUT_ROWS)


def packed_linear(x: torch.Tensor, packed: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a (rows, in) ``x`` and a ``pack_weight`` result."""
    return _POINTWISE(x, packed, bias, "none", [], "")


@contextlib.contextmanager
def use_onednn_linear(model: Any, enabled: bool = True) -> Iterator[None]:
    """Inside the block, every ``nn.Linear`` of ``model`` multiplies through oneDNN."""
    if not enabled or not onednn_available(model):
        yield
        return
    groups = _input_sharing_groups(model)
    for group in groups:
        for linear, forward in zip(group, _onednn_forwards(group)):
            linear.forward = forward
    try:
        yield
    finally:
        for group in groups:
            for linear in group:
                del linear.forward  # back to the class's own forward


# Sibling layers that attention and MLP blocks (Llama, Qwen2, Mistral, ...) apply to one input.
_SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def _input_sharing_groups(model: Any) -> list[list[torch.nn.Linear]]:
    """Every linear layer once: siblings known to share an input together, the rest alone."""
    grouped: list[list[torch.nn.Linear]] = []
    seen: set[int] = set()
    for parent in model.modules():
        for names in _SHARED_INPUT:
            group = [getattr(parent, n, None) for n in names]
            if all(isinstance(g, torch.nn.Linear) for g in group) and len(
                    {g.in_features for g in group}) == 1:
                grouped.append(group)
                seen.update(id(g) for g in group)
    alone = [[m] for m in model.modules()
             if isinstance(m, torch.nn.Linear) and id(m) not in seen]
    return grouped + alone


def _onednn_forwards(group: list[torch.nn.Linear]) -> list[Any]:
    """Forwards for layers sharing an input: the first computes one product for all of them
    (bit-identical to separate ones, one weight pass and call instead of several), the others
    take their slice when handed that same input tensor, and compute alone otherwise."""
    weight, bias = _reordered_weight(group)
    sizes = [linear.out_features for linear in group]
    pending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # position -> (input, output)

    def product(x: torch.Tensor, w: Any, b: torch.Tensor | None, n: int) -> torch.Tensor:
        y = packed_linear(x.reshape(-1, x.shape[-1]), w, b)
        return y.reshape(*x.shape[:-1], n)

    def first(x: torch.Tensor) -> torch.Tensor:
        parts = product(x, weight, bias, sum(sizes)).split(sizes, dim=-1)
        pending.update({i: (x, part) for i, part in enumerate(parts[1:], 1)})
        return parts[0]

    def later(i: int) -> Any:
        def forward(x: torch.Tensor) -> torch.Tensor:
            held = pending.pop(i, None)
            if held is not None and held[0] is x:
                return held[1]
            alone_weight, alone_bias = _reordered_weight([group[i]])
            return product(x, alone_weight, alone_bias, sizes[i])
        return forward

    return [first] + [later(i) for i in range(1, len(group))]


def _reordered_weight(group: list[torch.nn.Linear]) -> tuple[Any, torch.Tensor | None]:
    """The group's weights stacked in oneDNN's layout (reordered again if one changed), and
    their biases stacked (zeros for a layer without one)."""
    version = tuple((g.weight.data_ptr(), g.weight._version) for g in group)
    with _lock:
        cached = _reordered.get(group[0])
        if cached is None or cached[0] != version:
            weight = torch.cat([g.weight.detach() for g in group])
            biases = [g.bias for g in group]
            bias = None if all(b is None for b in biases) else torch.cat([
                torch.zeros(g.out_features, dtype=g.weight.dtype, device=g.weight.device)
                if g.bias is None else g.bias.detach() for g in group])
            cached = (version, (pack_weight(weight), bias))
            _reordered[group[0]] = cached
        return cached[1]
