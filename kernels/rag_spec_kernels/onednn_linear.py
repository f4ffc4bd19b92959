"""Linear layers through oneDNN on the CPU, for the few-token matrix products of verification.

The stock CPU path (``F.linear`` on BLAS) is fast for one token but slow for 2-32 (on the
machine DESIGN.md describes, a 16-token step costs 2.1x a 1-token step); oneDNN's kernels on a
blocked weight layout make the same step cost 1.6x its own 1-token step and 1.35x the stock one,
which is what lets a verified tree pay for itself. The reordered weights are a copy, made once
per layer and kept while the layer's weight tensor is unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch

_reordered: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[Any, Any]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()
# oneDNN's inner product on a reordered weight, taking and returning dense tensors (no layout
# conversions per call), and the reorder into the blocked layout oneDNN picks for a batch size.
_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
# The batch size the weight layout is tuned for: measured here, a layout for 16 rows makes
# 1-16-row products ~30% faster than oneDNN's plain layout (it streams the weight better).
_LAYOUT_ROWS = 16


def onednn_available(model: Any) -> bool:
    """oneDNN applies to float32 / bfloat16 models on the CPU."""
    return (torch.backends.mkldnn.is_available() and _POINTWISE is not None
            and _REORDER is not None
            and model.device.type == "cpu"
            and model.dtype in (torch.float32, torch.bfloat16))


@contextlib.contextmanager
def use_onednn_linear(model: Any, enabled: bool = True) -> Iterator[None]:
    """Inside the block, every ``nn.Linear`` of ``model`` multiplies through oneDNN."""
    if not enabled or not onednn_available(model):
        yield
        return
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    for linear in linears:
        linear.forward = _onednn_forward(linear)
    try:
        yield
    finally:
        for linear in linears:
            del linear.forward  # back to the class's own forward


def _onednn_forward(linear: torch.nn.Linear) -> Any:
    weight = _reordered_weight(linear)
    bias = None if linear.bias is None else linear.bias.detach()
    out_features = linear.out_features

    def forward(x: torch.Tensor) -> torch.Tensor:
        y = _POINTWISE(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], out_features)

    return forward


def _reordered_weight(linear: torch.nn.Linear) -> Any:
    """The layer's weight in oneDNN's layout, reordered again if the weight changed."""
    version = (linear.weight.data_ptr(), linear.weight._version)
    with _lock:
        cached = _reordered.get(linear)
        if cached is None or cached[0] != version:
            cached = (version, _REORDER(linear.weight.detach(), _LAYOUT_ROWS))
            _reordered[linear] = cached
        return cached[1]
