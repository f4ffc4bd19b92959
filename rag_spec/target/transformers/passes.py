"""Every forward pass over a module tree the fast path owns: a pass over one round of a
``TreeKVCache`` (eager with a compact tree mask, eager with a dense mask for a user's wrapped
module, or on a static cache through the compiled step), with the last hidden states kept when
a drafter reads them. The cache stores; the runner runs."""

from __future__ import annotations

import functools
from typing import Any

import torch

from rag_spec.errors import RagSpecError
from rag_spec.target.transformers.compiled_step import CompiledStep, rewind
from rag_spec.target.transformers.kv_cache import cache_argument
from rag_spec.target.transformers.step_inputs import TreeBatch, additive
from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec_kernels import (
    EXACT_TREE_ATTENTION,
    TREE_ATTENTION,
    TREE_ATTENTION_SDPA,
    tree_pass,
)


class ModuleRunner:
    """Forward passes of a module tree the fast path owns; call it like the model, or
    ``forward`` a pass of a tree cache's round."""

    compiled: CompiledStep | None = None  # passes on a static cache, if compiled

    def __init__(self, module: Any) -> None:
        self.module = module
        # read per step: a parameter's device and dtype, not transformers' properties, which
        # walk the module tree (tens of microseconds each); ``.to()`` moves this one too
        self._weight = next(p for p in module.parameters() if p.is_floating_point())

    @property
    def config(self) -> Any:
        """The private copy of the model's config (its attention selects tree attention)."""
        return self.module.config

    @property
    def device(self) -> torch.device:
        return self._weight.device

    @functools.cached_property
    def tree_attention(self) -> bool:
        """Whether every attention of the module tree runs ``tree_attention``, so passes may
        take compact tree masks (not where a user's wrapped module keeps its own config)."""
        configs = [config for module in self.module.modules()
                   if hasattr(config := vars(module).get("config"), "_attn_implementation")]
        return bool(configs) and all(c._attn_implementation in (
            TREE_ATTENTION, TREE_ATTENTION_SDPA, EXACT_TREE_ATTENTION) for c in configs)

    @property
    def dtype(self) -> torch.dtype:
        return self._weight.dtype

    def __call__(self, **inputs: Any) -> Any:
        with torch.inference_mode():
            return self.module(**inputs)

    def forward(self, cache: TreeKVCache, batch: TreeBatch, features: bool = False
                ) -> torch.Tensor:
        """Logits [B, W, vocab] of one pass over ``batch``, its KV entries written to
        ``cache``'s round. The compact mask goes where attention is ``tree_attention``
        (``tree_pass``); a user's wrapped module gets it spelled out as a dense mask. With
        ``features`` the pass also sets ``cache.step_features``, the model's last hidden
        states (``TreeKVCache.keep`` keeps the ones before the new roots)."""
        if cache.capacity is not None:
            return self._forward_static(cache, batch, features)
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
                  **cache_argument(self, cache.cache)}
        if batch.mask is None:
            return self._eager(cache, features, attention_mask=batch.attention_mask, **inputs)
        if not self.tree_attention:
            allowed = batch.mask.over_cache(cache.length)
            return self._eager(cache, features, attention_mask=additive(allowed, self.dtype),
                               **inputs)
        with tree_pass(batch.mask) as current:
            logits = self._eager(cache, features, **inputs)
        if not current.applied:
            msg = (f"{type(self.module).__name__} computes attention without transformers' "
                   "attention functions, so rag-spec's tree masks cannot reach it; use "
                   "model.generate for this model.")
            raise RagSpecError(msg)
        return logits

    def release(self, cache: TreeKVCache) -> None:
        """Return a static cache to the compiled step that lent it (its CUDA graphs replay
        over it in the next generation); ``cache`` is not used after this."""
        if cache.capacity is not None and self.compiled is not None:
            self.compiled.give_back(cache.cache, cache.valid.shape[0], cache.capacity)

    def _eager(self, tree: TreeKVCache, features: bool, /, **inputs: Any) -> torch.Tensor:
        """A pass through the module itself; with ``features``, its last hidden states kept
        (asked for only then: a user's wrapped module need not take the keyword)."""
        if features:
            inputs["output_hidden_states"] = True
        out = self(use_cache=True, **inputs)
        tree.step_features = out.hidden_states[-1] if features else None
        return out.logits

    def _forward_static(self, cache: TreeKVCache, batch: TreeBatch, features: bool
                        ) -> torch.Tensor:
        """``forward`` on a static cache: the pass writes after the round's earlier slots and
        attends through a dense mask over all ``capacity`` slots. Where the runner has a
        compiled step, one-token passes (plain steps) run compiled, and every pass where the
        step is ``wide`` (CUDA graphs on a GPU, oneDNN products on a CPU); with ``features``
        too, where the model's logits are its LM head over its last hidden states
        (``CompiledStep.features_split``)."""
        assert cache.capacity is not None and batch.mask is not None
        end = cache.length + cache.round_length
        if end > cache.capacity:
            msg = (f"This pass needs {end} slots, more than the static cache's "
                   f"{cache.capacity}: a drafter wrote a larger round than the decoder's "
                   "budget provides for.")
            raise RagSpecError(msg)
        rewind(cache.cache, end - batch.input_ids.shape[1])
        mask = additive(batch.mask.over_cache(cache.length), self.dtype, cache.capacity)
        inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids,
                  "attention_mask": mask}
        step = self.compiled
        if features and step is not None and not step.features_split:
            msg = (f"{type(self.module).__name__} turns its last hidden states into logits "
                   "with more than its LM head, which a compiled step cannot return apart: "
                   "drafts that read the target's hidden states (FeatureDrafter) need "
                   "LookaheadConfig(compile=False) with this model.")
            raise RagSpecError(msg)
        width = batch.input_ids.shape[1]
        if step is not None and (step.wide or width == 1):
            padded = step.bucket(width)
            if end - width + padded > cache.capacity:  # no slots for the padding: as it is
                padded = width
            out = step(**padded_inputs(inputs, padded), cache=cache.cache, features=features)
            logits, features_out = out if features else (out, None)
            cache.step_features = None if features_out is None else features_out[:, :width]
            return logits[:, :width]
        return self._eager(cache, features, **inputs, **cache_argument(self, cache.cache))


def padded_inputs(inputs: dict[str, Any], width: int) -> dict[str, Any]:
    """A static pass's ``inputs`` padded to ``width`` tokens: each row's last token repeated,
    at its position, seeing what it sees. No real token sees the padding's slots (they lie after
    the round's), and the next pass or round overwrites them."""
    extra = width - inputs["input_ids"].shape[1]
    if extra <= 0:
        return inputs

    def repeat_last(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        last = tensor.narrow(dim, tensor.shape[dim] - 1, 1)
        return torch.cat([tensor, *[last] * extra], dim)

    return {**inputs, "input_ids": repeat_last(inputs["input_ids"], 1),
            "position_ids": repeat_last(inputs["position_ids"], 1),
            "attention_mask": repeat_last(inputs["attention_mask"], 2)}
