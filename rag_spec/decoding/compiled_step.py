"""Forward passes compiled with ``torch.compile``, gpt-fast style, over a static KV cache.

A compiled pass needs shapes it can trace once: the cache is transformers' ``StaticCache``
(every layer preallocated for the whole answer, written in place) and a pass's mask is dense
over all of its slots, so nothing in the pass depends on how many are filled. Shapes are
dynamic, so one compilation serves every tree width above one (a single token gets its own)
and every cache length; inductor turns each layer's norms, rotary embedding, activation and
residual additions into a few fused kernels (C++ on a CPU) around the matrix products.

A static layer writes where its ``cumulative_length`` says; ``rewind`` moves that back, so a
verification round's rejected entries are overwritten by the next pass.
"""

from __future__ import annotations

import threading
from typing import Any

import torch


class CompiledStep:
    """``module``'s forward pass compiled; call it like the module with a static cache and a
    dense mask over the cache's slots; returns the logits. One call at a time: compiling is
    not thread-safe, and on a CPU two passes at once slow each other anyway."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self._compiled = torch.compile(self._forward, dynamic=True)
        self._lock = threading.Lock()

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor, past_key_values: Any) -> torch.Tensor:
        return self.module(input_ids=input_ids, position_ids=position_ids,
                           attention_mask=attention_mask, past_key_values=past_key_values,
                           use_cache=True).logits

    def __call__(self, **inputs: Any) -> torch.Tensor:
        with self._lock, torch.inference_mode():
            return self._compiled(**inputs)


def static_cache(config: Any, capacity: int) -> Any:
    """An empty ``StaticCache`` of ``capacity`` slots per layer for a model of ``config``."""
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=capacity)


def rewind(cache: Any, length: int) -> None:
    """Make the next write to every layer of a static ``cache`` land at slot ``length``."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.cumulative_length.fill_(length)
