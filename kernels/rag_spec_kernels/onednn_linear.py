"""Linear layers through oneDNN on the CPU, for the few-token matrix products of verification.

The stock CPU path (``F.linear`` on BLAS) is fast for one token but slow for 2-32; oneDNN's
kernels on a blocked weight layout make a few-token step cost much less, which is what lets a
verified tree pay for itself (measured: docs/concepts.md, "Why the defaults"). On AVX-512 and
AVX2 CPUs float32 stacks take ``streamed_linear`` instead, which also hides the weight's read
behind the arithmetic. Which kernel wins for a single row depends on the CPU: on an AMX Xeon the
streamed kernel does (without it, BLAS's matrix-vector product beats oneDNN's), on an AVX2 EPYC
the stack's product does (MKL runs one-row products on one core there); ``one_row_streamed``
and ``one_row_packed`` decide; on an Intel CPU, a prompt's products of many rows take BLAS
(``blas_from_rows``). Layers that read the same input (q/k/v, gate/up) multiply as one
stacked weight: one call and one weight pass, bit-identical results.

The reordered weights are a copy (as large as the layers' weights), made when a stack is built
and redone by ``LinearStack.refresh`` if a layer's weight changed. ``OneDNNLinear`` modules are
built for a private copy of a model's module tree: the caller's own layers are never modified.

A compiled module tree takes ``TracedLinear`` layers: the stack's product on the same packed
weights as the eager layers (no second copy), called by inductor around its fused kernels, and
single rows as reductions inductor compiles itself (on Intel CPUs the streamed kernel's:
``one_row_streamed``). The streamed kernel is an operator in C++
(``rag_spec_cpu::streamed_linear``); oneDNN's reordered weight is an opaque tensor inductor
cannot lower, so its products go through a Python operator (``rag_spec::stack_product``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from rag_spec_kernels.cpu_extension import cpu_info
from rag_spec_kernels.quantized import (
    GroupQuantized,
    pack_quantized,
    quantized_available,
    quantized_linear,
    stackable,
    stacked,
)
from rag_spec_kernels.streamed import (
    pack_streamed,
    quantized,
    streamed_available,
    streamed_linear,
)

# oneDNN's inner product on a reordered weight, taking and returning dense tensors (no layout
# conversions per call), and the reorder into the blocked layout oneDNN picks for a batch size.
_POINTWISE = getattr(torch.ops.mkldnn, "_linear_pointwise", None)
_REORDER = getattr(torch.ops.mkldnn, "_reorder_linear_weight", None)
# The batch size the weight layout is tuned for: a layout for 16 rows makes 1-16-row products
# faster than oneDNN's plain layout (it streams the weight better; ``python -m lab.floor``).
_LAYOUT_ROWS = 16

# Sibling layers that attention and MLP blocks (Llama, Qwen2, Mistral, ...) apply to one input.
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def onednn_ops_available() -> bool:
    """This torch build has oneDNN and the two operators below (the PyPI CPU wheels do)."""
    return (torch.backends.mkldnn.is_available() and _POINTWISE is not None
            and _REORDER is not None)


def onednn_available(model: Any) -> bool:
    """oneDNN applies to float32 models on the CPU, and to bfloat16 ones where the CPU has the
    instructions oneDNN's bfloat16 kernels need (AVX-512 or AVX-NE-CONVERT; not on AVX2-only
    CPUs such as AMD's Zen 3, where the stock kernels run instead)."""
    return (onednn_ops_available() and model.device.type == "cpu"
            and model.dtype in (torch.float32, torch.bfloat16) and onednn_packs(model.dtype))


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN reorders and multiplies ``dtype`` weights on this CPU (tried once)."""
    if not onednn_ops_available():
        return False
    try:
        packed_linear(torch.ones(1, 16, dtype=dtype), pack_weight(torch.ones(16, 16, dtype=dtype)))
    except RuntimeError:
        return False
    return True


def pack_weight(weight: torch.Tensor) -> Any:
    """A (out, in) weight reordered into oneDNN's blocked layout for products of 1-16 rows."""
    return _REORDER(weight, _LAYOUT_ROWS)


def packed_linear(x: torch.Tensor, packed: Any, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a (rows, in) ``x`` and a ``pack_weight`` result."""
    return _POINTWISE(x, packed, bias, "none", [], "")


@functools.cache
def one_row_packed(dtype: torch.dtype) -> bool:
    """Whether single rows multiply through oneDNN too: on AMD CPUs, where torch's BLAS (MKL)
    computes a one-row product on one core and oneDNN's reads the weight with every core, at
    more bandwidth (``python -m lab.floor``). Decided by the CPU, not timed, so that a process's
    rounding does not depend on how busy the machine was when it started."""
    return onednn_packs(dtype) and torch.backends.mkl.is_available() and _cpu_vendor() == "AMD"


@functools.cache
def one_row_streamed() -> bool:
    """Whether single rows take the streamed kernel where a stack has it, in eager and compiled
    steps alike: on Intel CPUs, where it reads a one-token step's weights faster than MKL's
    matrix-vector product and than inductor's reduction (docs/concepts.md, "Why the
    defaults"); a row then rounds as it does inside a tree. Not on AMD CPUs,
    where inductor's reduction reads at the memory's pace. Decided by the CPU, not timed
    (``one_row_packed``)."""
    return _cpu_vendor() == "Intel"


@functools.cache
def blas_from_rows(dtype: torch.dtype) -> int | None:
    """The row count from which a stack's products take torch's BLAS instead of the streamed
    kernel, or None: on Intel CPUs, where MKL's large-matrix kernels win for a prompt's many
    rows, from about a hundred rows up (measured on an AMX Xeon VM on the default model's
    layers). Not on AMD CPUs,
    where MKL takes slower code paths. Decided by the CPU, not timed (``one_row_packed``)."""
    return 128 if torch.backends.mkl.is_available() and _cpu_vendor() == "Intel" else None


def _cpu_vendor() -> str:
    """The CPU's maker: AMD, Intel, or an empty string where not known (not Linux, another)."""
    return {"AuthenticAMD": "AMD", "GenuineIntel": "Intel"}.get(cpu_info().get("vendor_id", ""),
                                                                "")


def is_plain_linear(module: Any) -> bool:
    """Exactly ``nn.Linear`` with the class's own forward: subclasses (quantised layers) and
    layers whose forward someone wrapped keep their own maths."""
    return type(module) is torch.nn.Linear and "forward" not in vars(module)


class LinearStack:
    """Sibling linear layers that read one input, multiplied through one stacked weight.

    The first layer's product computes every sibling's output; the others take their slice when
    handed that same input tensor on the same thread, and compute alone otherwise. A single row
    takes BLAS's per-layer products unless ``one_row_packed`` says oneDNN is faster. Where
    ``streamed_available`` (and not turned off by ``streamed``), float32 products take the
    kernel that prefetches the weight (``streamed_linear``) in oneDNN's place, on its own packed
    copy. The weights
    are reordered when the stack is made and again by ``refresh`` if a layer's weight changed
    (checking costs ~2 us a layer, so it is done once per generation, not per product).
    ``stored=torch.float16`` keeps the streamed copy in half precision, ``torch.int8`` as 8-bit
    integers with a scale per output (``quantized``), every row count through the streamed
    kernel: a half or a quarter of the bytes per product, for layers whose outputs need not
    equal the float32 layers' (a draft head's); ignored where the streamed kernel is not
    available. ``blocks``: the layers' weights as a GGUF file quantised them, which every row
    count then multiplies by (``quantized_linear``, where it runs; ``quantized`` says so); they
    are the file's, packed once and not held after (a file's blocks are memory-mapped, and
    every page packing read would stay resident): a change to the float32 layers later is not
    seen.
    """

    def __init__(self, linears: list[torch.nn.Linear], streamed: bool = True,
                 stored: torch.dtype | None = None,
                 blocks: list[GroupQuantized] | None = None) -> None:
        self.linears = linears
        self.sizes = [linear.out_features for linear in linears]
        self.out_features = sum(self.sizes)
        self._alone: dict[int, LinearStack] = {}
        self._pending = threading.local()  # index -> (input, output), per thread
        self._lock = threading.Lock()
        self._version: tuple = ()
        # the layers' quantised weights (a GGUF file's), multiplied as they are
        self.quantized = bool(blocks) and quantized_available()
        self.streamed = (streamed and not self.quantized
                         and streamed_available(linears[0].weight.dtype))
        self.stored = stored if self.streamed else None
        if self.quantized:
            self._packed = (pack_quantized(stacked(blocks)), self._bias(), None)
        self.refresh()
        # single rows on the streamed kernel, compiled too (``one_row_streamed``)
        self.one_row_streamed = self.streamed and one_row_streamed()
        # a narrow copy takes the streamed (or quantised) kernel for every row count: BLAS
        # would read the float32 weight
        self.one_row_packed = (one_row_packed(linears[0].weight.dtype) or bool(self.stored)
                               or self.one_row_streamed or self.quantized)
        self.blas_from_rows = (blas_from_rows(linears[0].weight.dtype)
                               if self.streamed and not self.stored else None)

    @property
    def nbytes(self) -> int:
        """Memory of the reordered copy: the stacked weights' size (as stored)."""
        if self.quantized:
            return sum(part.nbytes for part in self._packed[0])
        return sum(linear.weight.numel() * (self.stored or linear.weight.dtype).itemsize
                   for linear in self.linears)

    def modules(self) -> list[OneDNNLinear]:
        """One module per layer, to put in place of the layers in a private module tree."""
        return [OneDNNLinear(self, i) for i in range(len(self.linears))]

    def traced_modules(self, key: int = 0) -> list[TracedLinear]:
        """One module per layer for a module tree that ``torch.compile`` traces; ``key``: this
        stack's place in the ``stack_table`` its passes run under (oneDNN's products)."""
        shared = _Shared()
        return [TracedLinear(linear, self, i, shared, key)
                for i, linear in enumerate(self.linears)]

    def refresh(self) -> None:
        """Reorder the weights again if one of them changed (in place or replaced) since."""
        version = tuple((g.weight.data_ptr(), g.weight._version) for g in self.linears)
        with self._lock:
            if version == self._version or self.quantized:
                return  # unchanged, or a file's quantised weights (packed once); the float32
                # layers are not read then (a model loaded from a file maps their pages in
                # only as something reads them)
            bias, scale = self._bias(), None
            weight = torch.cat([g.weight.detach() for g in self.linears])
            if self.stored == torch.int8:
                weight, scale = quantized(weight)
            packed = (pack_streamed(weight, None if scale is not None else self.stored)
                      if self.streamed else pack_weight(weight))
            if self.streamed and self._version:  # traced layers hold these very tensors
                for held, made in zip(self._packed, (packed, bias, scale)):
                    if made is not None:
                        held.copy_(made)
            else:
                self._packed = (packed, bias, scale)
            self._version = version
            alone = list(self._alone.values())
        for stack in alone:
            stack.refresh()

    def _bias(self) -> torch.Tensor | None:
        """The layers' biases side by side (zeros for a layer without), or None for none."""
        if all(g.bias is None for g in self.linears):
            return None
        return torch.cat([torch.zeros(g.out_features, dtype=g.weight.dtype,
                                      device=g.weight.device)
                          if g.bias is None else g.bias.detach() for g in self.linears])

    def forward(self, index: int, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if (rows == 1 and not self.one_row_packed  # BLAS's matrix-vector product
                or self.blas_from_rows is not None and rows >= self.blas_from_rows):
            linear = self.linears[index]
            return torch.nn.functional.linear(x, linear.weight, linear.bias)
        pending = self._pending.__dict__.setdefault("outputs", {})
        if index == 0:
            parts = self.product(x).split(self.sizes, dim=-1)
            pending.update({i: (x, part) for i, part in enumerate(parts[1:], 1)})
            return parts[0]
        held = pending.pop(index, None)
        if held is not None and held[0] is x:
            return held[1]
        if self.quantized:  # rare (an input the siblings do not share): every output again,
            # this layer's taken (each output is computed alone, so the same numbers)
            start = sum(self.sizes[:index])
            return self.product(x).narrow(-1, start, self.sizes[index])
        with self._lock:  # rare (an input the siblings do not share): built once, packed
            if index not in self._alone:
                self._alone[index] = LinearStack([self.linears[index]], self.streamed,
                                                 self.stored)
            alone = self._alone[index]
        return alone.product(x)

    def product(self, x: torch.Tensor, packed: tuple[Any, Any, Any] | None = None
                ) -> torch.Tensor:
        """Every layer's output for ``x``, side by side in the stack's order; ``packed``: the
        stack's packed weight, bias and scale as a traced layer holds them (the same
        tensors)."""
        weight, bias, scale = packed or self._packed
        rows = x.reshape(-1, x.shape[-1])
        if self.quantized:
            y = quantized_linear(rows, weight, self.out_features, bias)
        else:
            y = (streamed_linear(rows, weight, self.out_features, bias, scale) if self.streamed
                 else packed_linear(rows, weight, bias))
        return y.reshape(*x.shape[:-1], self.out_features)


class _StandIn(torch.nn.Module):
    """A module in a linear layer's place that holds that layer's very Parameters (shared, not
    copied) and its sizes."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features


class OneDNNLinear(_StandIn):
    """A linear layer computed through its ``LinearStack`` (same parameters, no copy of them
    beyond the stack's reordered weight)."""

    def __init__(self, stack: LinearStack, index: int) -> None:
        super().__init__(stack.linears[index])
        self.stack = stack
        self.index = index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stack.forward(self.index, x)


def linear_stacks(root: torch.nn.Module, own: set[int], streamed: bool = True,
                  stored: torch.dtype | None = None,
                  blocks: Mapping[str, GroupQuantized] | None = None
                  ) -> list[tuple[torch.nn.Module, str, LinearStack, int]]:
    """Every plain linear layer under ``root`` among the modules whose ids are in ``own``, as
    (parent, attribute name, stack, index in stack): siblings known to share an input stacked
    together, the others alone; ``stored``: the streamed copies' precision; ``blocks``: layers'
    quantised weights by module path under ``root`` (siblings stack only if all or none have
    them, in forms one product takes: ``stackable``) (``LinearStack``)."""
    blocks = blocks or {}
    found: list[tuple[torch.nn.Module, str, LinearStack, int]] = []
    taken: set[int] = set()
    for path, parent in root.named_modules():
        for names in SHARED_INPUT:
            group = [parent._modules.get(n) for n in names]
            weights = [blocks.get(f"{path}.{n}" if path else n) for n in names]
            if all(id(g) in own and is_plain_linear(g) for g in group) and len(
                    {g.in_features for g in group}) == 1 and (
                    all(w is None for w in weights) or None not in weights
                    and stackable(weights)):
                stack = LinearStack(group, streamed, stored,
                                    None if weights[0] is None else weights)
                found += [(parent, n, stack, i) for i, n in enumerate(names)]
                taken.update(id(g) for g in group)
    for path, parent in root.named_modules():
        for name, child in parent._modules.items():
            if id(child) in own and id(child) not in taken and is_plain_linear(child):
                weight = blocks.get(f"{path}.{name}" if path else name)
                found.append((parent, name, LinearStack([child], streamed, stored,
                                                        None if weight is None else [weight]),
                              0))
                taken.add(id(child))
    return found


# The stacks traced layers name by key (their place in this table), set per thread around a
# compiled pass (``stack_table``): an operator's arguments are tensors and numbers, not
# objects, and a key that is a place in the runner's own table means the same in a later
# process, so a step compiled ahead of time calls this process's stacks.
_ACTIVE = threading.local()


@contextlib.contextmanager
def stack_table(stacks: Sequence[LinearStack]) -> Iterator[None]:
    """Let traced layers on this thread find their stacks in ``stacks`` (by key) meanwhile."""
    previous = getattr(_ACTIVE, "stacks", None)
    _ACTIVE.stacks = stacks
    try:
        yield
    finally:
        _ACTIVE.stacks = previous


@torch.library.custom_op("rag_spec::stack_product", mutates_args=())
def stack_product(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """``LinearStack.product`` of the stack ``key`` names in the thread's ``stack_table``, as
    an operator ``torch.compile`` and AOTInductor call without tracing into it."""
    stacks = getattr(_ACTIVE, "stacks", None)
    if stacks is None:
        msg = "rag_spec::stack_product runs inside stack_table(...) only (a compiled pass)"
        raise RuntimeError(msg)
    return stacks[key].product(x)


@stack_product.register_fake
def _stack_product_shape(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], out_features)


class _Shared:
    """The last stack product of a set of sibling ``TracedLinear`` layers and its input.

    An instance attribute from the start: ``torch.compile`` guards on where an attribute lives,
    and one first set on the instance by the first pass would make the second pass compile
    the step all over again (seconds on two cores)."""

    def __init__(self) -> None:
        self.last: tuple[torch.Tensor, torch.Tensor] | None = None


class TracedLinear(_StandIn):
    """A linear layer for a module tree ``torch.compile`` traces on a CPU (same parameters).

    A single row is a sum over the weight's rows, which inductor compiles into a vectorised
    reduction streaming the weight faster than oneDNN's one-row product and BLAS's read it
    (``python -m lab.floor --compiled``); run eagerly,
    that sum would build an (out, in) temporary, so these layers are for compiled trees only.
    Where ``one_row_streamed`` says so (Intel CPUs), a single row takes the stack's streamed
    product instead.

    Wider inputs go through the layer's ``LinearStack`` where it has one: the first sibling
    runs the stack's product, the others take their slice of it when handed the same input
    (tracing sees one product per stack), and the last one drops it. A sibling handed another
    input computes the whole product again (correct, slower; no model known here does that).
    Without a stack, the stock product. One pass at a time: the compiled step holds a lock.
    """

    def __init__(self, linear: torch.nn.Linear, stack: LinearStack | None = None,
                 index: int = 0, shared: _Shared | None = None, key: int = 0) -> None:
        super().__init__(linear)
        self.stack = stack
        if stack is not None:
            self.key = key
            self.start = sum(stack.sizes[:index])
            self.first_sibling, self.last_sibling = index == 0, index == len(stack.sizes) - 1
            self.shared = shared
            # buffers: the compiler checks a module's tensors cheaply
            if stack.quantized:  # a file's quantised weights
                for name, tensor in zip(("packed_values", "packed_scales", "packed_mins",
                                         "packed_factors"), stack._packed[0], strict=True):
                    self.register_buffer(name, tensor, persistent=False)
                self.register_buffer("packed_bias", stack._packed[1], persistent=False)
            elif stack.streamed:
                self.register_buffer("packed", stack._packed[0], persistent=False)
                self.register_buffer("packed_bias", stack._packed[1], persistent=False)
                self.register_buffer("packed_scale", stack._packed[2], persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() == x.shape[-1] and (self.stack is None or not (
                self.stack.one_row_streamed or self.stack.quantized)):
            y = (x.unsqueeze(-2) * self.weight).sum(-1)
            return y if self.bias is None else y + self.bias
        if self.stack is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        held = self.shared.last
        if self.first_sibling or held is None or held[0] is not x:
            if self.stack.quantized:  # operators, both
                product = self.stack.product(x, ((self.packed_values, self.packed_scales,
                                                  self.packed_mins, self.packed_factors),
                                                 self.packed_bias, None))
            elif self.stack.streamed:
                product = self.stack.product(x, (self.packed, self.packed_bias,
                                                 self.packed_scale))
            else:
                product = stack_product(x, self.key, self.stack.out_features)
            held = (x, product)
        self.shared.last = None if self.last_sibling else held
        return held[1].narrow(-1, self.start, self.out_features)
