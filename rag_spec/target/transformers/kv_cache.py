"""KV caches the decoder understands: transformers' DynamicCache with full-length layers.

Its layers are ``SlabLayer``s: keys and values are views of a preallocated slab, so a step
appends in place. transformers' ``DynamicLayer`` concatenates instead, which copies the whole
cache every step (at batch 16 x 4k context, most of a step's time).

Speculation writes draft entries and then keeps only accepted ones, so every layer must hold
every position: a sliding-window layer that drops old entries by itself would lose the slots
being compacted. Sliding-window attention is therefore applied by the masks
(``attention_window``), over full layers: on every layer (Mistral) or on the sliding layers of
models that mix them with full ones (Gemma 3, Cohere2, Qwen2's ``max_window_layers``); other
layer kinds are refused with a clear error.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Any

import torch

from rag_spec.errors import RagSpecError

_SUPPORTED_LAYERS = ("full_attention", "sliding_attention")


def new_cache() -> Any:
    """An empty cache of full-length slab layers (created as the model fills them)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    cache.layer_class_to_replicate = _slab_layer()
    return cache


@functools.cache
def _slab_layer() -> type:
    """``SlabLayer``, defined on first use (transformers is imported lazily)."""
    from transformers.cache_utils import DynamicLayer

    class SlabLayer(DynamicLayer):
        """A DynamicLayer that appends in place: ``keys`` and ``values`` are prefix views of
        slabs with spare room, regrown by an eighth (at least 256 slots) when full. Anything
        that assigns them a prefix view of themselves (cropping, compaction) keeps the slab."""

        slabs: tuple[torch.Tensor, torch.Tensor] | None = None

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            old = self.slabs or (None, None)
            key_slab, self.keys = _append(old[0], self.keys, key_states)
            value_slab, self.values = _append(old[1], self.values, value_states)
            self.slabs = (key_slab, value_slab)
            return self.keys, self.values

    return SlabLayer


def _append(slab: torch.Tensor | None, current: torch.Tensor, new: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """``current`` (a prefix view of ``slab``, or empty) followed by ``new`` along slots: the
    slab (regrown if it had no room) and the view. The slab is tracked explicitly: views made
    under ``torch.inference_mode`` do not record their base."""
    length = current.shape[-2] if current.dim() == 4 else 0
    end = length + new.shape[-2]
    fits = (slab is not None and _prefix_of(slab, current) and slab.shape[-2] >= end
            and slab.shape[:2] == new.shape[:2] and slab.shape[-1] == new.shape[-1])
    if not fits:
        slab = new.new_empty(*new.shape[:2], end + max(256, end // 8), new.shape[-1])
        if length:
            slab[:, :, :length] = current
    assert slab is not None
    slab[:, :, length:end] = new
    return slab, slab[:, :, :end]


def _prefix_of(slab: torch.Tensor | None, current: torch.Tensor) -> bool:
    """Whether ``current`` is still a prefix view (along slots) of ``slab``."""
    return (slab is not None and current.dim() == 4 and current.data_ptr() == slab.data_ptr()
            and current.stride() == slab.stride())


def keep_batch_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep only the batch rows ``index`` of every layer of ``cache``, copied once; a slab
    layer keeps its spare room, so appends stay in place."""
    for layer in layers(cache):
        slabs = layer.slabs if isinstance(layer, _slab_layer()) else None
        length = layer.keys.shape[2]
        if slabs is not None and _prefix_of(slabs[0], layer.keys) \
                and _prefix_of(slabs[1], layer.values):
            layer.slabs = tuple(slab.index_select(0, index) for slab in slabs)
            layer.keys, layer.values = (slab[:, :, :length] for slab in layer.slabs)
        else:
            layer.keys, layer.values = (tensor.index_select(0, index)
                                        for tensor in (layer.keys, layer.values))


@dataclass(frozen=True)
class SlidingWindow:
    """A sliding attention window: a query sees the keys of the ``size`` latest positions up to
    its own (transformers' rule), on every layer, or with ``mixed`` only on the layers of kind
    ``"sliding_attention"``, the others attending in full (a mask per kind)."""

    size: int
    mixed: bool = False


def attention_window(config: Any) -> SlidingWindow | None:
    """The sliding window the model's layers attend within, or None for full attention.

    Raises RagSpecError for layer kinds the decoder's masks do not express (other than full
    and sliding).
    """
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    window = getattr(config, "sliding_window", None)
    kinds = set(getattr(config, "layer_types", None) or ())
    if not kinds:  # no per-layer types: a set window applies to every layer (Mistral)
        return SlidingWindow(int(window)) if window else None
    unknown = kinds - set(_SUPPORTED_LAYERS)
    if unknown:
        msg = (f"{type(config).__name__} has attention layers rag-spec cannot mask yet "
               f"({', '.join(sorted(unknown))}); rag-spec supports full and sliding-window "
               "attention layers (Llama, Qwen, Mistral, Gemma 3, ...). Use model.generate for "
               "this model.")
        raise RagSpecError(msg)
    if "sliding_attention" not in kinds or not window:
        return None
    return SlidingWindow(int(window), mixed=len(kinds) > 1)


def layers(cache: Any) -> list:
    """The per-layer key/value holders of ``cache``, refusing layers that evict entries."""
    from transformers.cache_utils import DynamicLayer, StaticLayer

    found = getattr(cache, "layers", None)
    full_length = (DynamicLayer, _slab_layer(), StaticLayer)
    if found is None or not all(type(layer) in full_length for layer in found):
        kinds = sorted({type(layer).__name__ for layer in found or ()}) or [type(cache).__name__]
        msg = (f"rag-spec needs a transformers DynamicCache of full-length layers (got "
               f"{', '.join(kinds)}); create it with "
               "rag_spec.target.transformers.kv_cache.new_cache() (sliding windows are applied "
               "by the masks).")
        raise RagSpecError(msg)
    return found


def fill_only(model: Any) -> dict[str, Any]:
    """Forward options for a pass that only fills the cache: no logits where the model (or the
    runner's copy of it) can skip them (a prompt's logits cost 49k x 576 multiply-adds per
    token for the default model)."""
    module = getattr(model, "module", model)
    return {"logits_to_keep": 1} if _skips_logits(type(module)) else {}


@functools.cache
def _skips_logits(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def cache_argument(model: Any, cache: Any) -> dict[str, Any]:
    """``cache`` as the keyword the model's forward takes it by: ``cache`` in transformers
    releases that renamed it (``past_key_values`` is deprecated there, and goes in 5.40),
    ``past_key_values`` in earlier ones."""
    module = getattr(model, "module", model)
    return {_cache_keyword(type(module)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def crop(cache: Any, length: int) -> None:
    """Keep the first ``length`` positions of every layer (``DynamicCache.crop``, whose
    argument conventions changed across transformers releases)."""
    for layer in layers(cache):
        layer.keys = layer.keys[:, :, :length]
        layer.values = layer.values[:, :, :length]
