"""The kNN-LM's keys: a hidden state of the model at each position, read on a private copy.

Two places to read it. Khandelwal et al. (2020) found the first better, and so does the
embedded model on held-out text (its nearest entry's token is right more often:
``rag-spec bench knnlm --compare-keys``, docs/benchmarks/knnlm_keys.json):

- ``"ffn_input"``: the input of the last layer's feed-forward block, after its norm;
- ``"final"``: the final norm's output, the vector the LM head reads.

Both are captured by a forward hook on the ``Runner``'s private module tree, so the user's
model never carries a hook.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Literal

import torch

from rag_spec.errors import RagSpecError
from rag_spec.target.transformers.kv_cache import cache_argument
from rag_spec.target.transformers.runner import Runner, RunnerSettings

KeyKind = Literal["ffn_input", "final"]
KEY_KINDS: tuple[str, ...] = ("ffn_input", "final")


class KeyedLM:
    """Forward passes that return the next-token logits and the key at every position.

    Take them from ``KeyedLM.of(model, key)``: one per model and key, as its runner holds a
    copy of the linear weights (oneDNN's layout) that every datastore build and ``KNNLM`` of
    that model then shares. Calls are serialised (the hook's capture is per instance)."""

    _cache: weakref.WeakKeyDictionary[Any, dict[str, KeyedLM]] = weakref.WeakKeyDictionary()
    _cache_lock = threading.Lock()

    def __init__(self, model: Any, key: KeyKind = "ffn_input") -> None:
        if key not in KEY_KINDS:
            msg = f"Unknown key {key!r}; use one of {', '.join(KEY_KINDS)}."
            raise RagSpecError(msg)
        self.key = key
        # Our own runner (not the shared ``Runner.of``): the hook below lives on its copy only.
        self.runner = Runner(model, RunnerSettings())
        self._captured: list[torch.Tensor] = []
        self._lock = threading.Lock()
        _key_module(self.runner.module, key).register_forward_hook(self._capture)

    @classmethod
    def of(cls, model: Any, key: KeyKind = "ffn_input") -> KeyedLM:
        """The shared ``KeyedLM`` of ``model`` and ``key``, built on first use and kept while
        the model lives (its weight copies refreshed if weights changed in place since)."""
        with cls._cache_lock:
            keyed = cls._cache.setdefault(model, {}).get(key)
            if keyed is None:
                keyed = cls._cache[model][key] = cls(model, key)
        for stack in keyed.runner.stacks:
            stack.refresh()
        return keyed

    def _capture(self, _module: Any, _inputs: Any, output: torch.Tensor) -> None:
        self._captured.append(output)

    def __call__(self, input_ids: torch.Tensor, cache: Any = None) -> tuple[torch.Tensor,
                                                                             torch.Tensor]:
        """(logits [batch, seq, vocab], keys [batch, seq, dim]) in float32; ``cache``: a KV
        cache the pass continues and extends (None: none)."""
        with self._lock:
            self._captured.clear()
            cached = {} if cache is None else cache_argument(self.runner, cache)
            out = self.runner(input_ids=input_ids, use_cache=cache is not None, **cached)
            return out.logits.float(), self._captured.pop().float()

    def keys(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Keys alone [batch, seq, dim] (float32): the LM head, a fifth of a small model's
        work, is skipped (building a datastore)."""
        with self._lock, torch.inference_mode():
            self._captured.clear()
            self.runner.module.model(input_ids=input_ids, attention_mask=attention_mask,
                                     use_cache=False)
            return self._captured.pop().float()


def _key_module(model: Any, key: KeyKind) -> torch.nn.Module:
    """The module whose output is the key, in a Llama-style model (``model.layers``, each with
    a ``post_attention_layernorm``, and a final ``model.norm``)."""
    base = getattr(model, "model", None)
    if key == "final":
        module, where = getattr(base, "norm", None), "final norm (model.norm)"
    else:
        layers = getattr(base, "layers", None)
        module = getattr(layers[-1], "post_attention_layernorm", None) if layers else None
        where = "last layer's post_attention_layernorm"
    if not isinstance(module, torch.nn.Module):
        msg = (f"{type(model).__name__} has no {where} to read kNN-LM keys from; models of "
               "the Llama family (Llama, Mistral, Qwen2, SmolLM) have one.")
        raise RagSpecError(msg)
    return module
