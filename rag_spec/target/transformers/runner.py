"""The decoder's fast path over a user's model, on a private copy: the user's modules and config
are never written.

A ``Runner`` holds a copy of the model's module tree that shares every parameter (a shallow
copy per module: its own child, parameter and hook tables, the same tensors). In that copy:

- attention configs are private copies selecting ``tree_attention`` (through transformers'
  public attention registry), which reads each KV head once for a whole token tree;
- on the CPU, plain ``nn.Linear`` layers become oneDNN layers over a reordered weight copy,
  which keeps few-token verification steps cheap. The copy is as large as the linear weights,
  so by default ("auto") it is made only while it fits ``onednn_memory_share`` of the memory
  available when the runner is built (on the machine DESIGN.md describes: yes for models up to
  ~1.5B parameters in fp32); ``Runner.extra_bytes`` says what was spent.

With ``exact`` (by default for half-precision models on the CPU), the copy instead computes
every token of a step bit for bit as a one-token step (``rag_spec_kernels.exact``): per-token
attention, stock linear kernels in row chunks they compute row-invariantly. Output then equals
``generate``'s in bfloat16 too, where rounding differences otherwise change tokens.

With ``compile``, the runner also holds a ``CompiledStep`` (``torch.compile``) of a second
private copy, which steps on a static cache take: inductor fuses each layer's norms, rotary
embedding and activation, saving per-operator overhead. Where the first copy multiplies through
oneDNN, the second calls the same products (``TracedLinear``, one operator per stack, no second
weight copy) and every step runs compiled; on the stock kernels (oneDNN off) only one-token
steps do on a CPU, as inductor's products over trees lose to the eager kernels there. On a CPU
single rows become reductions inductor compiles, which read the weights faster than BLAS's or
oneDNN's one-row products.

With ``quantized``, a model loaded from a GGUF file multiplies by the file's own 4- and 8-bit
weights (``rag_spec.target.gguf`` reads them; ``quantized_linear``), every row count and in
compiled steps too (a package of their own): another model than the float32 layers, whose
greedy output equals its own decoding without drafts.

Modules whose ``forward`` someone replaced (accelerate's offload hooks, a user's wrapper) are
not copied: the runner calls them as they are, so the user's wrapper keeps working, on the
stock kernels. Runners are built once per (model, settings) and held weakly by the model.
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch

from rag_spec.errors import RagSpecError
from rag_spec.target import gguf
from rag_spec.target.transformers import step_package
from rag_spec.target.transformers.compiled_step import CompiledStep
from rag_spec.target.transformers.passes import ModuleRunner
from rag_spec_kernels import (
    LinearStack,
    OneDNNLinear,
    RowChunkedLinear,
    TracedLinear,
    invariant_rows,
    is_plain_linear,
    linear_stacks,
    onednn_available,
    quantized_available,
    register_tree_attention,
    row_attention_available,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSettings:
    """Kernel settings of the fast path (drafting settings live with the drafter)."""

    onednn_linear: bool | Literal["auto"] = "auto"  # CPU: oneDNN matrix products (weight copy)
    onednn_memory_share: float = 0.25  # "auto": the copy may take this share of free memory
    # the copy packed for rag-spec's streamed kernel where the CPU takes it (float32 on
    # AVX-512 or AVX2; ``rag_spec_kernels.streamed``), else for oneDNN's
    streamed_linear: bool = True
    # CPU, float32: steps attend through rag-spec's AVX-512 kernel (``cpu_tree_attention``)
    # where the CPU takes it, else through SDPA
    cpu_attention: bool = True
    # every token of a step computed bit for bit as a one-token step (``rag_spec_kernels.exact``;
    # stock linear kernels, no oneDNN copy). "auto": for half-precision models that run SDPA
    # attention (CPU or GPU), where rounding differences change greedy tokens
    exact: bool | Literal["auto"] = False
    # steps compiled on a static cache (not with exact numerics): every step on a CPU with
    # oneDNN products (one-token steps only without), as CUDA graphs on a GPU. "auto": on a
    # CPU, where this machine holds the model's package of steps compiled ahead of time
    # (``step_package``), never compiling; True: the package, else torch.compile at first use
    compile: bool | Literal["auto"] = "auto"
    # CPU, float32, a model loaded from a GGUF file: linear layers multiply by the file's
    # quantised weights (``rag_spec.target.gguf``), compiled steps from a package of their own;
    # "auto": wherever that applies (``LookaheadConfig.quantized``)
    quantized: bool | Literal["auto"] = False


class Runner(ModuleRunner):
    """Forward passes of ``model`` through the fast path; call it like the model.

    Examples:
        >>> runner = Runner.of(model)                                    # doctest: +SKIP
        >>> runner(input_ids=ids, **cache_argument(runner, cache)).logits  # doctest: +SKIP
    """

    _cache: weakref.WeakKeyDictionary[Any, dict[RunnerSettings, Runner]] = (
        weakref.WeakKeyDictionary())
    _cache_lock = threading.Lock()

    def __init__(self, model: Any, settings: RunnerSettings) -> None:
        self.settings = settings
        self.source = _structure(model)
        self.exact = _wants_exact(model, settings)
        blocks = _file_weights(model, settings, self.exact)
        # 8-bit inputs turn the smallest difference into a different integer: a tree's rows
        # must attend exactly as their one-token steps do
        rows = bool(blocks) and quantized_available() and row_attention_available()
        module, own = _private_tree(model, self.exact, settings.cpu_attention, rows)
        super().__init__(module)
        self.extra_bytes = 0  # memory of weight copies the fast path made
        self.stacks: list[LinearStack] = []
        if blocks and not rows:
            log.warning("rag-spec: the quantised products or the row attention kernel do not "
                        "run here; the GGUF file's weights are multiplied de-quantised")
            blocks = {}
        # what the linear layers multiply by: "GGUF" (the file's own blocks) or the dtype's name
        self.weights = "GGUF" if blocks else str(model.dtype).removeprefix("torch.")
        # every pass, prefill too, multiplies and attends row by row: a token's entries are
        # the same whatever pass computed them (a prompt whole, in chunks, padded in a batch,
        # or one token at a time), which 8-bit inputs need (they turn the smallest rounding
        # difference into other tokens) and which lets prompts reuse stored prefixes
        self.row_invariant = bool(blocks) and _every_layer_quantized(module, blocks)
        if self.exact:
            _chunk_rows(self.module, own)
        elif blocks or _wants_onednn(model, settings):
            for parent, name, stack, index in linear_stacks(self.module, own,
                                                            settings.streamed_linear,
                                                            blocks=blocks):
                parent._modules[name] = stack.modules()[index]
                if index == 0:
                    self.stacks.append(stack)
                    self.extra_bytes += stack.nbytes
        self._step: CompiledStep | None = None  # also where a package may be built
        if settings.compile is True or settings.compile == "auto" and not self.exact and (
                self.device.type == "cpu"):
            compiled, compiled_own = _private_tree(model, False, settings.cpu_attention, rows)
            stacks = (_traced_linears(compiled, compiled_own, self.module)
                      if self.device.type == "cpu" else [])
            self._step = CompiledStep(compiled, wide=bool(self.stacks), stacks=stacks)
            self._step.package = step_package.load(self._step)
            if settings.compile is True or self._step.package is not None:
                self.compiled = self._step

    def package_steps(self, progress: bool = True) -> Any:
        """Compile this runner's steps ahead of time into a package this machine keeps
        (minutes; once per model architecture, dtype and machine), and run them from now on;
        returns its folder. Later processes load it (``compile="auto"``, the default)."""
        if self._step is None or self.device.type != "cpu":
            msg = ("Steps are packaged ahead of time on a CPU, without exact numerics "
                   "(LookaheadConfig(exact=False)); on a GPU, compile=True compiles them as "
                   "CUDA graphs at first use.")
            raise RagSpecError(msg)
        if self._step.package is None:
            from rag_spec.progress import progress as progress_bar

            step_package.build(self._step, lambda graphs: progress_bar(
                graphs, "compiling decoding steps ahead of time", "graph", enabled=progress))
            self._step.package = step_package.load(self._step)
        self.compiled = self._step
        return step_package.package_dir(self._step)

    @classmethod
    def of(cls, model: Any, settings: RunnerSettings | None = None) -> Runner:
        """The runner for ``model`` with ``settings``, built on first use and kept while the
        model lives; built again if the model's modules or parameters were replaced since, its
        weight copies refreshed if weights changed in place. Call it once per generation."""
        settings = settings or RunnerSettings()
        with cls._cache_lock:
            runners = cls._cache.setdefault(model, {})
            runner = runners.get(settings)
            if runner is None or runner.source != _structure(model):
                runner = runners[settings] = cls(model, settings)
        for stack in runner.stacks:  # weights changed in place since: reorder them again
            stack.refresh()
        return runner


def _structure(model: Any) -> tuple[int, ...]:
    """Identities of the model's modules and parameters, and where each parameter's data lies:
    what the private copy was built from. Weights changed in place are seen through the shared
    tensors; replaced objects are not, nor data moved by ``model.to(...)`` (a step compiled
    ahead of time holds the addresses of the tensors it was given)."""
    return (*map(id, model.modules()),
            *(part for p in model.parameters() for part in (id(p), p.data_ptr())))


def _private_tree(model: Any, exact: bool, cpu_attention: bool, rows: bool = False
                  ) -> tuple[Any, set[int]]:
    """A copy of ``model``'s module tree sharing its parameters, with private attention configs
    (tree attention: exact, steps on ``row_attention``, on our CPU kernel or on SDPA); also the
    ids of the copied modules (the ones the runner may change).

    Tree attention computes what SDPA computes; a transformers model that declares SDPA cannot
    compute its attention (ALiBi biases, attention sinks, soft-capped logits: Bloom, GPT-OSS,
    Gemma 2) is refused rather than decoded wrongly."""
    if getattr(model, "_supports_sdpa", True) is False:
        msg = (f"{type(model).__name__}'s attention is not what SDPA computes (ALiBi biases, "
               "attention sinks or soft-capped logits: Bloom, GPT-OSS, Gemma 2), and rag-spec's "
               "tree attention computes SDPA's; use model.generate for this model.")
        raise RagSpecError(msg)
    implementation = register_tree_attention(exact, cpu_attention, rows)
    memo: dict[int, Any] = {}
    configs: dict[int, Any] = {}
    for module in model.modules():
        config = vars(module).get("config")
        if hasattr(config, "_attn_implementation") and id(config) not in configs:
            configs[id(config)] = copy.deepcopy(config, memo)  # sub-configs copied once
    for config in configs.values():
        config._attn_implementation = implementation  # also sets it on its sub-configs
    own: set[int] = set()

    def clone(module: torch.nn.Module) -> torch.nn.Module:
        if "forward" in vars(module):  # someone's wrapper: call it as it is
            return module
        twin = copy.copy(module)
        for name, value in vars(twin).items():  # own tables, shared tensors
            if isinstance(value, dict | set):
                vars(twin)[name] = copy.copy(value)
        twin._modules = {name: None if child is None else clone(child)
                         for name, child in module._modules.items()}
        config = vars(module).get("config")
        if id(config) in configs:
            vars(twin)["config"] = configs[id(config)]
        own.add(id(twin))
        return twin

    if "forward" in vars(model):
        log.info("rag-spec: %s.forward is wrapped; decoding through the wrapper on the stock "
                 "kernels.", type(model).__name__)
    return clone(model), own


def _traced_linears(compiled: torch.nn.Module, own: set[int], eager: torch.nn.Module
                    ) -> list[LinearStack]:
    """Put ``TracedLinear`` layers in place of the plain linear layers of ``compiled`` (a CPU
    model's private tree; ``own``: its copied modules): on the oneDNN products of ``eager``'s
    layers where it has them, on the same reordered weights, else on the stock ones. Returns
    the stacks in the order their keys number them (the tree's order: the same in every
    process, so a step compiled ahead of time calls the right ones)."""
    stacked = {path: module for path, module in eager.named_modules()
               if isinstance(module, OneDNNLinear)}
    siblings: dict[int, list[TracedLinear]] = {}
    stacks: list[LinearStack] = []
    owned = [(path, parent) for path, parent in compiled.named_modules() if id(parent) in own]
    for path, parent in owned:
        for name, child in list(parent._modules.items()):
            if id(child) not in own or not is_plain_linear(child):
                continue
            eager_layer = stacked.get(f"{path}.{name}" if path else name)
            if eager_layer is None:
                parent._modules[name] = TracedLinear(child)
                continue
            stack = eager_layer.stack
            if id(stack) not in siblings:
                siblings[id(stack)] = stack.traced_modules(len(stacks))
                stacks.append(stack)
            parent._modules[name] = siblings[id(stack)][eager_layer.index]
    return stacks


def _every_layer_quantized(module: torch.nn.Module, blocks: dict[str, Any]) -> bool:
    """Whether every linear layer that computes KV entries multiplies by the file's blocks
    (the output head only makes logits): a de-quantised layer's float products round by the
    pass's row count, so its entries would depend on the pass."""
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    return all(path in blocks for path, child in module.named_modules()
               if is_plain_linear(child) and child is not head)


def _wants_exact(model: Any, settings: RunnerSettings) -> bool:
    """Whether to run exact numerics; they reproduce transformers' SDPA attention, so a model
    set to another attention cannot have them, and one-token steps, which a compiled step's
    fused kernels do not."""
    implementation = getattr(model.config, "_attn_implementation", None)
    if settings.compile is True and settings.exact is True:
        msg = ("A compiled step fuses operations and rounds differently from transformers' "
               "one-token step, so it cannot have exact numerics: use "
               "LookaheadConfig(compile=True, exact=False), or compile=False.")
        raise RagSpecError(msg)
    if settings.exact == "auto":
        return (model.dtype in (torch.bfloat16, torch.float16) and implementation == "sdpa"
                and settings.compile is not True)
    if settings.exact and implementation != "sdpa":
        msg = (f"Exact numerics reproduce transformers' SDPA attention, but this model runs "
               f"{implementation!r} attention: load it with attn_implementation='sdpa', or use "
               f"LookaheadConfig(exact=False).")
        raise RagSpecError(msg)
    return bool(settings.exact)


def _chunk_rows(root: torch.nn.Module, own: set[int]) -> None:
    """Put a ``RowChunkedLinear`` (same parameters) in place of every plain linear layer
    under ``root`` among the modules in ``own``: it multiplies rows in chunks its kernel
    computes as it computes each row alone."""
    probed: dict[tuple[Any, ...], tuple[int, ...]] = {}
    for parent in list(root.modules()):
        if id(parent) not in own:
            continue
        for name, child in list(parent._modules.items()):
            if id(child) in own and is_plain_linear(child):
                shape = (*child.weight.shape, child.weight.dtype, child.weight.device,
                         child.bias is None)
                if shape not in probed:
                    probed[shape] = invariant_rows(child)
                parent._modules[name] = RowChunkedLinear(child, probed[shape])


def _file_weights(model: Any, settings: RunnerSettings, exact: bool) -> dict[str, Any]:
    """The quantised weights of ``model``'s layers from its GGUF file, where ``quantized`` asks
    for them and they apply (a float32 model on the CPU, loaded from a GGUF file); under
    "auto", only where the kernels run here too, else none, silently."""
    if settings.quantized is False:
        return {}
    applies = not exact and model.device.type == "cpu" and model.dtype == torch.float32
    if settings.quantized == "auto":
        if not (applies and gguf.source_file(model) is not None and quantized_available()
                and row_attention_available()):
            return {}
        return gguf.file_weights(model)
    if not applies:
        msg = ("LookaheadConfig(quantized=True) multiplies by a GGUF file's weights on the "
               "CPU, in float32 arithmetic, without exact numerics: load the model with "
               "device='cpu' and dtype float32, and leave exact at 'auto' or False.")
        raise RagSpecError(msg)
    weights = gguf.file_weights(model)
    if not weights:
        log.info("rag-spec: %s was not loaded from a GGUF file (or none of its layers has a "
                 "quantised kernel): LookaheadConfig(quantized=True) decodes it in float32",
                 type(model).__name__)
    return weights


def _wants_onednn(model: Any, settings: RunnerSettings) -> bool:
    if settings.onednn_linear is False or not onednn_available(model):
        return False
    if settings.onednn_linear is True:
        return True
    size = sum(m.weight.numel() * m.weight.element_size() for m in model.modules()
               if isinstance(m, torch.nn.Linear))
    free = available_memory()
    if free is not None and size > settings.onednn_memory_share * free:
        log.info("rag-spec: oneDNN weight copy (%.1f GB) skipped: over %.0f%% of the %.1f GB "
                 "available; LookaheadConfig(onednn_linear=True) forces it.", size / 1e9,
                 100 * settings.onednn_memory_share, free / 1e9)
        return False
    return True


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux ``MemAvailable``), if known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
