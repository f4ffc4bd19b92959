"""Forward passes compiled with ``torch.compile``, gpt-fast style, over a static KV cache.

A compiled pass needs shapes it can trace once: the cache is transformers' ``StaticCache``
(every layer preallocated for the whole answer, written in place) and a pass's mask is dense
over all of its slots, so nothing in the pass depends on how many are filled. Shapes are
dynamic, so one compilation serves every tree width above one (a single token gets its own)
and every cache length; inductor turns each layer's norms, rotary embedding, activation and
residual additions into a few fused kernels (C++ on a CPU) around the matrix products.

A static layer writes where its ``cumulative_length`` says; ``rewind`` moves that back, so a
verification round's rejected entries are overwritten by the next pass.

On a GPU a step is launch-bound (hundreds of small kernels against a few milliseconds of weight
reads), so there the step is also captured as CUDA graphs (``mode="reduce-overhead"``): one
graph per pass width, replayed in one launch, and every width runs compiled (trees padded to a
few widths, ``bucket``). A graph replays over the cache tensors it recorded, so the step lends
its static caches out and takes them back (``lend``, ``give_back``) instead of making one per
generation.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import torch

from rag_spec.target.transformers.kv_cache import cache_argument
from rag_spec_kernels import LinearStack, stack_table


class CompiledStep:
    """``module``'s forward pass compiled; call it like the module with a static cache and a
    dense mask over the cache's slots; returns the logits, or with ``features=True`` the logits
    and the last hidden states (what the LM head read: ``features_split`` says whether this
    model's logits are just that). ``wide``: ``module`` multiplies through oneDNN
    (``TracedLinear``; ``stacks``: the table their keys index), so tree passes pay compiled
    too. Passes run through ``package`` where one is loaded (compiled ahead of time:
    ``step_package``), else through ``torch.compile`` at first use. One call at a time:
    compiling is not thread-safe, and on a CPU two passes at once slow each other anyway."""

    def __init__(self, module: torch.nn.Module, wide: bool = False,
                 stacks: Sequence[LinearStack] = ()) -> None:
        self.module = module
        self.stacks = tuple(stacks)
        self.graphs = next(module.parameters()).device.type == "cuda"
        self._wide = wide
        self.package: Any = None  # a ``step_package.LoadedPackage``, set by the runner
        self._lock = threading.Lock()
        self._spare: tuple[tuple[int, int], Any] | None = None  # (batch, slots), a cache

    @functools.cached_property
    def _compiled(self) -> Any:
        """The step through ``torch.compile``, made at first use: a step that runs a loaded
        package never needs it, and making it imports most of inductor (docs/concepts.md,
        "Why the defaults")."""
        return torch.compile(functools.partial(step_forward, self.module), dynamic=True,
                             mode="reduce-overhead" if self.graphs else None)

    @functools.cached_property
    def features_split(self) -> bool:
        """Whether the model's logits are its LM head over its decoder's last hidden states,
        bit for bit (probed once on a few tokens): not where a model scales or caps them."""
        decoder, head = self.module.get_decoder(), self.module.get_output_embeddings()
        if decoder is None or head is None or decoder is self.module:
            return False
        device = next(self.module.parameters()).device
        probe = torch.arange(1, 4, device=device)[None]
        with self._lock, torch.inference_mode(), stack_table(self.stacks):
            logits = self.module(input_ids=probe, use_cache=False).logits
            split = head(decoder(input_ids=probe, use_cache=False).last_hidden_state)
        return torch.equal(logits, split)

    @property
    def kind(self) -> str:
        """How its passes run: "compiled ahead of time" (a loaded package) or "compiled"."""
        return "compiled" if self.package is None else "compiled ahead of time"

    @property
    def wide(self) -> bool:
        """Whether passes of every width run compiled, not only one-token ones: on a GPU, and
        on a CPU where the module's products are oneDNN's (``wide``); inductor's own products
        over trees lose to the eager kernels there."""
        return self._wide or self.graphs

    def bucket(self, width: int) -> int:
        """The width a pass of ``width`` tokens runs at. CUDA graphs record one graph per
        width, at its first pass (a pause in the middle of an answer), so there
        trees are padded to 2, 4, 8 or a multiple of 8 tokens: a few graphs serve them all.
        Elsewhere one compilation serves every width, and passes run as they are."""
        if not self.graphs or width <= 2:
            return width
        return 1 << (width - 1).bit_length() if width <= 8 else -(-width // 8) * 8

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor, cache: Any, features: bool = False) -> Any:
        with self._lock, torch.inference_mode(), stack_table(self.stacks):
            if self.package is not None:
                allocate(cache, self.module, input_ids.shape[0])
                return self.package(input_ids, position_ids, attention_mask, cache, features)
            inputs = {"input_ids": input_ids, "position_ids": position_ids,
                      "attention_mask": attention_mask, "features": features,
                      **cache_argument(self.module, cache)}
            if not self.graphs:
                return self._compiled(**inputs)
            torch.compiler.cudagraph_mark_step_begin()
            out = self._compiled(**inputs)  # the next replay reuses the graph's outputs
            return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()

    def capacity(self, slots: int) -> int:
        """The slots of a static cache that must hold ``slots``: with CUDA graphs, in steps of
        256, so prompts of nearby lengths share one cache and replay its graphs."""
        return -(-slots // 256) * 256 if self.graphs else slots

    def lend(self, batch: int, capacity: int) -> Any:
        """A static cache of ``capacity`` slots for ``batch`` rows: the one last given back if
        it has that shape (its graphs replay), else a new one. Give it back when done."""
        with self._lock:
            spare, self._spare = self._spare, None
        if spare is not None and spare[0] == (batch, capacity):
            rewind(spare[1], 0)
            return spare[1]
        return static_cache(self.module.config, capacity)

    def give_back(self, cache: Any, batch: int, capacity: int) -> None:
        """Keep ``cache`` (``batch`` rows, ``capacity`` slots) for the next ``lend``; one is
        kept at most, so memory stays one cache above what is in use."""
        with self._lock:
            self._spare = ((batch, capacity), cache)


def step_forward(module: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor, features: bool = False, **cache: Any
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """A pass of ``module`` as compilers trace it; ``cache``: the static cache under the
    keyword the model takes it by. Its hidden states come from the decoder and its LM
    head in turn (transformers records them with hooks and context variables, which the
    compiler cannot trace)."""
    inputs = {"input_ids": input_ids, "position_ids": position_ids,
              "attention_mask": attention_mask, "use_cache": True, **cache}
    if not features:
        return module(**inputs).logits
    hidden = module.get_decoder()(**inputs).last_hidden_state
    return module.get_output_embeddings()(hidden), hidden


def static_cache(config: Any, capacity: int) -> Any:
    """An empty ``StaticCache`` of ``capacity`` slots per layer for a model of ``config``."""
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=capacity)


def allocate(cache: Any, module: torch.nn.Module, batch: int) -> None:
    """Allocate a static ``cache``'s layers for ``batch`` rows where no pass has yet (a
    one-token prompt's first pass comes before any prefill wrote them): a package's graphs
    take every layer's tensors, where an eager pass allocates them itself (transformers'
    ``early_initialization``, as its export recipes use it)."""
    if all(layer.is_initialized for layer in cache.layers):
        return
    config = module.config.get_text_config()
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or \
        config.hidden_size // config.num_attention_heads
    weight = next(p for p in module.parameters() if p.is_floating_point())
    cache.early_initialization(batch, heads, head_dim, weight.dtype, weight.device)


def rewind(cache: Any, length: int) -> None:
    """Make the next write to every layer of a static ``cache`` land at slot ``length``."""
    for layer in cache.layers:
        if layer.is_initialized:
            layer.cumulative_length.fill_(length)
