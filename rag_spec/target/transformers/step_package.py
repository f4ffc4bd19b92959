"""Compiled steps built once per model architecture, dtype and machine, and loaded by every
later process in about a second: AOTInductor packages of the compiled step.

``torch.compile`` traces the model again in each new process, minutes on two cores even with
inductor's caches warm (docs/concepts.md, "Why the defaults"). A
package holds the step's graphs compiled into shared libraries: the one-token pass of one row
(its products as reductions) and the pass of any other shape (batch, width and cache capacity
dynamic; products through the runner's stacks). It holds no weights: the loaded graphs read the
private copy's own tensors (user-managed constants), so a package depends on the architecture,
not the weights, and takes a few MB.

A package's folder is named by a digest of everything its graphs depend on: the model's class
and config, dtype, the kernel each layer takes, the sources of the kernels and of this step,
torch's and transformers' versions, the CPU's instruction sets. A package that fails to load
is removed and the step runs eager (a warning names the command that builds it again); so does
a model whose package was built by other code (an upgrade, another CPU: a warning says so).
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
import logging
import platform
import shutil
import warnings
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

import rag_spec_kernels
from rag_spec.target.transformers.compiled_step import CompiledStep, static_cache, step_forward
from rag_spec.target.transformers.kv_cache import cache_argument
from rag_spec_kernels import TracedLinear, stack_table

log = logging.getLogger(__name__)

FORMAT = 1  # of the folder's layout; part of the digest
GRAPHS = ("one", "wide")  # one row of one token; any other shape
_INDUCTOR = {"aot_inductor.package_constants_in_so": False}  # weights come from the model


class _Pass(torch.nn.Module):
    """The step as ``torch.export`` takes it: the static cache as flat tensors (each layer's
    keys, values and write position), written in place by the pass."""

    def __init__(self, module: torch.nn.Module, features: bool) -> None:
        super().__init__()
        self.module = module
        self.features = features

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                attention_mask: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], lengths: list[torch.Tensor]) -> Any:
        cache = static_cache(self.module.config, keys[0].shape[2])
        for layer, key, value, length in zip(cache.layers, keys, values, lengths, strict=True):
            layer.keys, layer.values, layer.cumulative_length = key, value, length
            layer.device, layer.is_initialized = key.device, True
        return step_forward(self.module, input_ids, position_ids, attention_mask,
                            self.features, **cache_argument(self.module, cache))


def _flat(cache: Any) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    layers = cache.layers
    return ([layer.keys for layer in layers], [layer.values for layer in layers],
            [layer.cumulative_length for layer in layers])


class LoadedPackage:
    """A package's graphs bound to one compiled step's tensors; call it as the step."""

    def __init__(self, graphs: dict[str, Any], features: bool) -> None:
        self.graphs = graphs
        self.features = features  # the graphs return the last hidden states too

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor, cache: Any, features: bool) -> Any:
        graph = self.graphs["one" if input_ids.numel() == 1 else "wide"]
        out = graph(input_ids, position_ids, attention_mask, *_flat(cache))
        logits, hidden = out if self.features else (out, None)
        return (logits, hidden) if features else logits


def fingerprint(step: CompiledStep) -> str:
    """A digest of everything the step's compiled graphs depend on."""
    import transformers

    module = step.module
    layers = [(path, m.start, m.out_features, m.key, m.stack.streamed,
               m.first_sibling, m.last_sibling, _quantized(m.stack))
              if m.stack is not None else (path,)
              for path, m in module.named_modules() if isinstance(m, TracedLinear)]
    # probed here, before any tracing: under torch.export the probe's own tensors (a
    # generator among them) would be traced into the graph, and an AVX-512 CPU's kernel lost
    kernel = rag_spec_kernels.cpu_attention_available()
    parts = {"format": FORMAT, "model": _model(step),
             "attention": (module.config._attn_implementation, kernel), "layers": layers,
             "sources": _sources_digest(),
             "torch": torch.__version__, "transformers": transformers.__version__,
             "machine": platform.machine(), "cpu": rag_spec_kernels.vector_flags()}
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _model(step: CompiledStep) -> str:
    """Which model a package is for, whatever the code that built it: its class, config and
    dtype (a package for it built by other code is stale, not missing)."""
    config = step.module.config.to_dict()
    for name in ("_name_or_path", "transformers_version", "_commit_hash"):
        config.pop(name, None)
    parts = [type(step.module).__qualname__, config, str(next(step.module.parameters()).dtype)]
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _kernels(step: CompiledStep) -> list[list[bool]]:
    """Which kernel families the step's linear layers take (ours or not, streamed or not): a
    package for other kernels (an ablation's) is not this step's, stale or not."""
    kinds = {(m.stack is not None, m.stack is not None and m.stack.streamed,
              m.stack is not None and bool(_quantized(m.stack)))
             for m in step.module.modules() if isinstance(m, TracedLinear)}
    return [list(kind) for kind in sorted(kinds)]  # as JSON gives it back


def _quantized(stack: Any) -> list[Any]:
    """What a stack's quantised weights are, as its graph reads them (widths of values and
    scales, whether with minimums); empty for float weights."""
    if not stack.quantized:
        return []
    values, scales, mins, _ = stack._packed[0]
    return [str(values.dtype), str(scales.dtype), mins.numel() > 0]


@functools.cache
def _sources_digest() -> str:
    """A digest of the kernels' and the step's code, read once per process (every runner
    built with ``compile="auto"`` asks): their syntax trees without docstrings, so an edit to
    the prose (comments, docstrings) does not make a new package."""
    # by module name: ``rag_spec_kernels.tree_attention`` is also the function of that name
    kernels = [importlib.import_module(f"rag_spec_kernels.{name}") for name in (
        "onednn_linear", "streamed", "quantized", "tree_attention", "cpu_attention")]
    modules = [*kernels, inspect.getmodule(step_forward), inspect.getmodule(_Pass)]
    code = "".join(ast.dump(_without_docstrings(ast.parse(inspect.getsource(m))))
                   for m in modules)
    return hashlib.sha256(code.encode()).hexdigest()


def _without_docstrings(tree: ast.Module) -> ast.Module:
    """``tree`` with the docstring of its module, classes and functions taken out."""
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef
                          | ast.AsyncFunctionDef) or not node.body:
            continue
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                and isinstance(first.value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return tree


def package_dir(step: CompiledStep) -> Path | None:
    """Where ``step``'s package lives (it may not exist yet); None where rag-spec keeps no
    cache (a machine with only torch and transformers)."""
    try:
        from rag_spec.paths import cache_dir

        root = cache_dir()  # imports platformdirs
    except ImportError:
        return None
    name = type(step.module).__name__.lower()
    return root / "steps" / f"{name}-{fingerprint(step)}"


def load(step: CompiledStep) -> LoadedPackage | None:
    """``step``'s package bound to its tensors, or None if none was built on this machine for
    this architecture. A damaged one is removed (a warning says so) and None returned."""
    if step.module.training or next(step.module.parameters()).device.type != "cpu":
        return None
    folder = package_dir(step)
    if folder is None or not folder.is_dir():
        if folder is not None:
            _name_stale(folder, _model(step), _kernels(step))
        return None
    graphs = {}
    try:
        features = json.loads((folder / "package.json").read_text())["features"]
        tensors = _constants(step, features)
        for name in GRAPHS:
            graph = _load_graph(folder / f"{name}.pt2")
            graph.load_constants({fqn: tensors[fqn] for fqn in graph.get_constant_fqns()},
                                 check_full_update=True, user_managed=True)
            graphs[name] = graph
    except Exception as error:  # a damaged or foreign file: eager, and built again on request
        log.warning("rag-spec: the compiled steps in %s do not load (%s); removed, decoding "
                    "eagerly. `rag-spec models compile` (or decoder.package_steps()) builds "
                    "them again.", folder, error)
        shutil.rmtree(folder, ignore_errors=True)
        return None
    return LoadedPackage(graphs, features)


def _load_graph(path: Path) -> Any:
    """A package's graph, through AOTInductor's own loader without torch's check of the
    device: that check builds and loads a test library per instruction set, each in a
    subprocess, only to warn (docs/concepts.md, "Why the defaults"),
    and a package's digest already names the CPU's instruction sets. Where this torch's loader
    has another form, its public load."""
    try:
        from torch.export.pt2_archive._package import AOTICompiledModel

        loader = torch._C._aoti.AOTIModelPackageLoader
    except (ImportError, AttributeError):
        return torch._inductor.aoti_load_package(str(path))
    return AOTICompiledModel(loader(str(path), "model", False, 1, -1))


def _name_stale(folder: Path, model: str, kernels: list[list[bool]]) -> None:
    """Warn (once a process per package) where this model's steps, on the same kernels, were
    compiled by other code (rag-spec, torch or transformers upgraded, another CPU): the user
    would otherwise get eager steps, slower, without a word. A package built before packages
    named their kernels is taken to be on the same ones."""
    if folder in _named:
        return
    _named.add(folder)
    for other in sorted(folder.parent.glob("*/package.json")):
        try:
            built = json.loads(other.read_text())
            stale = built.get("model") == model and built.get("kernels", kernels) == kernels
        except (OSError, ValueError, AttributeError):
            continue
        if stale:
            log.warning("rag-spec: the compiled steps for this model in %s were built by other "
                        "code (an upgrade of rag-spec, torch or transformers, or another CPU); "
                        "decoding eagerly. `rag-spec models compile` (or "
                        "decoder.package_steps()) builds them for this one (a few minutes, "
                        "once).", other.parent)
            return


_named: set[Path] = set()


def _constants(step: CompiledStep, features: bool) -> dict[str, torch.Tensor]:
    """The step's parameters and buffers by the names the exported graphs give them."""
    wrapper = _Pass(step.module, features)
    named = [*wrapper.named_parameters(remove_duplicate=False),
             *wrapper.named_buffers(remove_duplicate=False)]
    return {name: tensor.detach() for name, tensor in named}


def build(step: CompiledStep, progress: Callable[[Iterable[str]], Iterable[str]] = iter
          ) -> Path:
    """Export ``step``'s graphs and compile them ahead of time into its package folder
    (minutes on a CPU: ~3 on two cores for a 135M model); ``progress`` wraps the graphs'
    loop (a progress bar)."""
    folder = package_dir(step)
    if folder is None:
        msg = "Compiled step packages are kept in rag-spec's cache: pip install platformdirs."
        raise RuntimeError(msg)
    from rag_spec.paths import atomic_dir

    wrapper = _Pass(step.module, step.features_split).eval()
    with atomic_dir(folder) as scratch, torch.no_grad(), stack_table(step.stacks), \
            warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)  # torch's own pytree notes
        for name in progress(GRAPHS):
            example, shapes = _example(step, batch=1 if name == "one" else 2,
                                       width=1 if name == "one" else 5)
            program = torch.export.export(wrapper, example, dynamic_shapes=shapes, strict=False)
            torch._inductor.aoti_compile_and_package(
                program, package_path=str(scratch / f"{name}.pt2"), inductor_configs=_INDUCTOR)
        (scratch / "package.json").write_text(json.dumps({"features": wrapper.features,
                                                          "model": _model(step),
                                                          "kernels": _kernels(step)}))
    return folder


def _example(step: CompiledStep, batch: int, width: int) -> tuple[tuple[Any, ...], Any]:
    """Inputs to trace a pass of ``batch`` rows of ``width`` tokens on, after 8 cached ones,
    and which of their dimensions vary (all but the one-token pass's batch and width)."""
    module = step.module
    device = next(module.parameters()).device
    capacity, start = 32, 8
    cache = static_cache(module.config, capacity)
    prompt = torch.ones(batch, start, dtype=torch.long, device=device)
    module(input_ids=prompt, use_cache=True, **cache_argument(module, cache))  # fills the cache
    keys, values, lengths = _flat(cache)
    dtype = next(p for p in module.parameters() if p.is_floating_point()).dtype
    mask = torch.full((batch, 1, width, capacity), torch.finfo(dtype).min, dtype=dtype,
                      device=device)
    for query in range(width):
        mask[:, 0, query, :start + query + 1] = 0
    ids = torch.ones(batch, width, dtype=torch.long, device=device)
    positions = torch.arange(start, start + width, device=device).expand(batch, width)
    dynamic = torch.export.Dim.DYNAMIC
    rows = tokens = torch.export.Dim.STATIC if width == 1 else dynamic
    per_layer = [{0: rows, 2: dynamic}] * len(keys)
    shapes = ({0: rows, 1: tokens}, {0: rows, 1: tokens},
              {0: rows, 2: tokens, 3: dynamic}, per_layer, per_layer,
              [None] * len(keys))
    return (ids, positions.contiguous(), mask, keys, values, lengths), shapes
