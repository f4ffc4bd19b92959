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

_reordered: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[Any, Any, Any]] = (
    weakref.WeakKeyDictionary())
_lock = threading.Lock()
# The same oneDNN inner product as mkldnn_linear (bit-identical results), taking and returning
# dense tensors; it saves two layout conversions (~25 us) on each of a step's ~200 calls.
_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None)


def onednn_available(model: Any) -> bool:
    """oneDNN applies to float32 / bfloat16 models on the CPU."""
    return (torch.backends.mkldnn.is_available() and model.device.type == "cpu"
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
    weight, bias = _weights(linear)
    out_features = linear.out_features
    dense_bias = None if linear.bias is None else linear.bias.detach()

    def forward(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if _POINTWISE is not None:  # dense in, dense out: no layout conversions per call
            y = _POINTWISE(flat, weight, dense_bias, "none", [], "")
        else:
            y = torch._C._nn.mkldnn_linear(flat.to_mkldnn(), weight, bias).to_dense()
        return y.reshape(*x.shape[:-1], out_features)

    return forward



def _weights(linear: torch.nn.Linear) -> tuple[Any, Any]:
    """The layer's weight and bias in oneDNN's layout, reordered again if the weight changed."""
    version = (linear.weight.data_ptr(), linear.weight._version)
    with _lock:
        cached = _reordered.get(linear)
        if cached is None or cached[0] != version:
            w = linear.weight.detach()
            b = (linear.bias.detach() if linear.bias is not None
                 else torch.zeros(linear.out_features, dtype=w.dtype))
            cached = (version, w.to_mkldnn(), b.to_mkldnn())
            _reordered[linear] = cached
        return cached[1], cached[2]
