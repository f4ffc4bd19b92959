"""The CPU kernels: oneDNN linear layers agree with F.linear and follow weight updates."""

import contextlib
import copy

import pytest
import torch

import rag_spec_kernels.onednn_linear as kernel
import rag_spec_kernels.slots as slot_kernel
from rag_spec_kernels import (
    LinearStack,
    OneDNNLinear,
    TracedLinear,
    is_plain_linear,
    linear_stacks,
    onednn_available,
    onednn_ops_available,
    pack_weight,
    stack_table,
)
from rag_spec_kernels.slots import move_slots, slots_kernel_available
from rag_spec_kernels.streamed import (
    pack_streamed,
    quantized,
    streamed_available,
    streamed_linear,
)


class Tiny(torch.nn.Module):
    def __init__(self, bias: bool):
        super().__init__()
        self.proj = torch.nn.Linear(24, 40, bias=bias)
        self.weight = self.proj.weight  # onednn_available reads model.device / model.dtype

    @property
    def device(self):
        return self.weight.device

    @property
    def dtype(self):
        return self.weight.dtype

    def forward(self, x):
        return self.proj(x)


def private_copy(model, traced=False):
    """``model`` with its linear layers replaced by oneDNN ones, in a copy (as the runner does);
    ``traced``: the layers ``torch.compile`` traces, and the copy's ``stacks`` (the table its
    passes run under, ``stack_table``)."""
    twin = copy.deepcopy(model)
    twin.load_state_dict(model.state_dict())
    own = {id(m) for m in twin.modules()}
    siblings, twin.stacks = {}, []
    for parent, name, stack, index in linear_stacks(twin, own):
        if index == 0:
            siblings[id(stack)] = (stack.traced_modules(len(twin.stacks)) if traced
                                   else stack.modules())
            twin.stacks.append(stack)
        parent._modules[name] = siblings[id(stack)][index]
    return twin


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (3, 5, 24), (16, 24)])
def test_onednn_linear_matches_f_linear(bias, shape):
    torch.manual_seed(0)
    model = Tiny(bias).eval()
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(shape)
    fast = private_copy(model)
    assert isinstance(fast.proj, OneDNNLinear) and type(model.proj) is torch.nn.Linear
    with torch.inference_mode():
        expected = model(x)
        got = fast(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_onednn_is_offered_only_for_the_dtypes_this_cpu_packs(dtype):
    # bfloat16 kernels need AVX-512 or AVX-NE-CONVERT: on an AVX2-only CPU (AMD Zen 3) oneDNN
    # refuses to pack bf16 weights, and the runner must take the stock kernels, not crash.
    model = Tiny(False).to(dtype).eval()
    if not onednn_ops_available():
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(3, 24, dtype=dtype)
    if onednn_available(model):
        fast = private_copy(model)
        with torch.inference_mode():
            torch.testing.assert_close(fast(x), model(x), rtol=2e-2, atol=2e-2)
    else:
        assert dtype == torch.bfloat16
        assert not kernel.one_row_packed(dtype)
        with pytest.raises(RuntimeError, match="bf16"):
            pack_weight(model.proj.weight.detach())


@pytest.mark.parametrize("traced", [False, True])
def test_onednn_linear_follows_weight_updates(traced):
    model = Tiny(True).eval()
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    x = torch.randn(2, 24)
    stack = LinearStack([model.proj])
    # a compiled layer holds the stack's packed tensors: refreshed in place, they stay its own
    layer = torch.compile(stack.traced_modules()[0], dynamic=True) if traced else \
        stack.modules()[0]
    with torch.inference_mode(), stack_table([stack]):
        layer(x)
        model.proj.weight.mul_(2)  # an in-place change must invalidate the reordered copy
        model.proj.bias.add_(1)
        stack.refresh()  # what the runner does once per generation
        got = layer(x)
        torch.testing.assert_close(got, torch.nn.functional.linear(
            x, model.proj.weight, model.proj.bias), rtol=1e-5, atol=1e-5)


def test_subclasses_and_wrapped_layers_keep_their_own_maths():
    class Quantised(torch.nn.Linear):
        pass

    wrapped = torch.nn.Linear(4, 4)
    wrapped.forward = lambda x: x
    assert not is_plain_linear(Quantised(4, 4))
    assert not is_plain_linear(wrapped)
    assert is_plain_linear(torch.nn.Linear(4, 4))


class Block(torch.nn.Module):
    """q/k/v and gate/up siblings, as Llama-family attention and MLP blocks have them."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(24, 32, bias=True)
        self.k_proj = torch.nn.Linear(24, 8, bias=False)  # mixed biases: zeros stand in
        self.v_proj = torch.nn.Linear(24, 8, bias=True)
        self.gate_proj = torch.nn.Linear(24, 40, bias=False)
        self.up_proj = torch.nn.Linear(24, 40, bias=False)
        self.weight = self.q_proj.weight

    device, dtype = Tiny.device, Tiny.dtype

    def forward(self, x, other=None):
        y = x if other is None else other  # ``other``: v_proj and up_proj see another input
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(y)
        mlp = torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(y)
        return torch.cat([q, k, v, mlp], dim=-1)


def block(monkeypatch, one_row_packed, streamed=False, one_row_streamed=False):
    """A seeded ``Block`` whose single rows go to the stack's kernel or not, as told (compiled
    too with ``one_row_streamed``), and whose stacks take the streamed kernel or oneDNN's
    (skips where the one asked for is missing)."""
    torch.manual_seed(0)
    model = Block().eval()
    if not onednn_available(model):
        pytest.skip("oneDNN is not available in this torch build")
    if streamed and not streamed_available(torch.float32):
        pytest.skip("the streamed kernel needs AVX-512 or AVX2 and a build")
    monkeypatch.setattr(kernel, "one_row_packed", lambda dtype: one_row_packed)
    monkeypatch.setattr(kernel, "one_row_streamed", lambda: one_row_streamed)
    monkeypatch.setattr(kernel, "streamed_available", lambda dtype: streamed)
    return model


def products_run(forward, model, x, other, monkeypatch):
    """``forward``'s and ``model``'s outputs on ``(x, other)``, checked close, and the packed
    weights of the stack products (oneDNN's or streamed) ``forward`` ran."""
    calls = []
    pointwise, streamed = torch.ops.mkldnn._linear_pointwise, kernel.streamed_linear
    with torch.inference_mode():
        expected = model(x, other)
        monkeypatch.setattr(kernel, "_POINTWISE", lambda *a: calls.append(a[1]) or pointwise(*a))
        monkeypatch.setattr(kernel, "streamed_linear",
                            lambda *a: calls.append(a[1]) or streamed(*a))
        got = forward(x, other)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    return got, expected, calls


@pytest.mark.parametrize(("streamed", "one_row_streamed"),
                         [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("one_row_packed", [False, True])
@pytest.mark.parametrize("shape", [(3, 24), (2, 13, 24), (1, 24)])
@pytest.mark.parametrize("shared", [True, False])
def test_input_sharing_layers_multiply_once_with_the_same_results(shape, shared, one_row_packed,
                                                                  streamed, one_row_streamed,
                                                                  monkeypatch):
    # the CPU's choices for single rows and kernels, fixed here so that every path is tested
    model = block(monkeypatch, one_row_packed, streamed, one_row_streamed)
    x = torch.randn(shape)
    got, expected, calls = products_run(private_copy(model), model, x,
                                        None if shared else torch.randn(shape), monkeypatch)
    if x.numel() == x.shape[-1] and not (one_row_packed or one_row_streamed):  # F.linear's BLAS
        assert not calls
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
        return
    # shared: one product for q/k/v and one for gate/up; otherwise v and up compute alone
    assert len(calls) == (2 if shared else 4)


@pytest.mark.parametrize("rows", [3, 4, 9])
def test_a_prompts_many_rows_multiply_as_blas_does_bit_for_bit(rows, monkeypatch):
    # on Intel CPUs MKL multiplies a prompt's many rows faster than the streamed kernel
    model = block(monkeypatch, one_row_packed=False, streamed=True)
    monkeypatch.setattr(kernel, "blas_from_rows", lambda dtype: 4)
    x = torch.randn(rows, 24)
    got, expected, calls = products_run(private_copy(model), model, x, None, monkeypatch)
    if rows >= 4:
        assert not calls
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    else:
        assert len(calls) == 2  # q/k/v and gate/up, streamed


@pytest.mark.parametrize("vendor", ["AMD", "Intel", ""])
def test_the_cpu_maker_decides_where_single_rows_and_a_prompts_rows_go(vendor, monkeypatch):
    # MKL multiplies one row on one core on AMD CPUs (oneDNN's kernel takes it there); on
    # Intel CPUs it multiplies a prompt's many rows faster than the streamed kernel
    monkeypatch.setattr(kernel, "_cpu_vendor", lambda: vendor)
    choices = (kernel.one_row_packed, kernel.blas_from_rows, kernel.one_row_streamed)
    for choice in choices:
        choice.cache_clear()
    try:
        packed, rows = (choice(torch.float32) for choice in choices[:2])
        streamed = kernel.one_row_streamed()
    finally:
        for choice in choices:
            choice.cache_clear()
    mkl = torch.backends.mkl.is_available()
    assert packed == (vendor == "AMD" and kernel.onednn_packs(torch.float32) and mkl)
    assert rows == (128 if vendor == "Intel" and mkl else None)
    # single rows on the streamed kernel, eager and compiled, on Intel CPUs only
    assert streamed == (vendor == "Intel")


def test_the_cpu_is_read_from_the_first_processor_and_named_in_every_report(monkeypatch):
    from rag_spec.bench.report import machine
    from rag_spec_kernels import cpu_extension

    text = ("processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n"
            "model name\t: Intel(R) Xeon(R) Platinum 8480+\nflags\t\t: fpu sse4_2 avx2 fma "
            "avx512f amx_tile amx_bf16 pku\n\nprocessor\t: 1\nvendor_id\t: AuthenticAMD\n")
    fields = cpu_extension._first_processor(text)
    assert (fields["vendor_id"], fields["cpu family"], fields["model"]) == ("GenuineIntel", "6",
                                                                            "143")
    monkeypatch.setattr(cpu_extension, "cpu_info", lambda: fields)
    monkeypatch.setattr(kernel, "cpu_info", lambda: fields)
    assert cpu_extension.vector_flags() == ["amx_bf16", "amx_tile", "avx2", "avx512f", "fma",
                                            "sse4_2"]
    assert kernel._cpu_vendor() == "Intel"
    import rag_spec_kernels

    monkeypatch.setattr(rag_spec_kernels, "cpu_info", lambda: fields)
    report = machine()
    assert (report["cpu"], report["cpu_family"], report["cpu_model"]) == (
        "Intel(R) Xeon(R) Platinum 8480+", "6", "143")
    assert "amx_bf16" in report["vector_flags"]


def test_every_kernel_builds_where_torch_runs_avx2_or_avx_512():
    """One source whose instructions the build's flags leave off fails the whole build, and
    every kernel's probe then says no: the tests that need a kernel skip, this one fails (the
    AVX-512 flags once left FMA and F16C off)."""
    import shutil

    from rag_spec_kernels import (
        cpu_attention_available,
        quantized_available,
        row_attention_available,
    )
    from rag_spec_kernels.cpu_extension import vector_isa

    if vector_isa() is None or shutil.which("c++") is None:
        pytest.skip("no AVX2 or AVX-512 here, or no compiler: nothing to build")
    assert quantized_available()
    assert streamed_available(torch.float32)
    assert row_attention_available()
    assert slots_kernel_available()
    assert cpu_attention_available() == (vector_isa() == "AVX512")


@pytest.mark.parametrize(("isa", "flags", "extensions"), [
    ("AVX512", "avx2 avx512f avx512_vnni", ["-mavx512vnni"]),
    ("AVX512", "avx2 avx512f", []),
    ("AVX2", "avx2 avx512_vnni", []),  # VNNI's 256-bit form needs AVX-512's encoding too
])
def test_vnni_byte_products_are_built_in_where_the_cpu_has_them(isa, flags, extensions,
                                                                monkeypatch):
    from rag_spec_kernels import cpu_extension

    monkeypatch.setattr(cpu_extension, "cpu_info", lambda: {"flags": flags})
    assert cpu_extension._extensions(isa) == extensions


@pytest.mark.slow
@pytest.mark.parametrize(("streamed", "one_row_streamed"),
                         [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (2, 13, 24)])
@pytest.mark.parametrize("shared", [True, False])
def test_traced_layers_multiply_once_per_stack_single_rows_reduce(shape, shared, compiled,
                                                                   streamed, one_row_streamed,
                                                                   monkeypatch):
    model = block(monkeypatch, one_row_packed=True, streamed=streamed,
                  one_row_streamed=one_row_streamed)
    traced = private_copy(model, traced=True)
    assert all(isinstance(traced.get_submodule(n), TracedLinear) for n in ("q_proj", "up_proj"))
    forward = torch.compile(traced, dynamic=True) if compiled else traced
    # the streamed kernel's own operator, called from the graph: never the Python one, which
    # refuses to run outside a table
    table = contextlib.nullcontext() if streamed else stack_table(traced.stacks)
    x = torch.randn(shape)
    with table:
        _, _, calls = products_run(forward, model, x, None if shared else torch.randn(shape),
                                   monkeypatch)
    if x.numel() == x.shape[-1] and not one_row_streamed:  # a single row: reductions over
        assert not calls  # the weights, no products
        return
    # shared: one product per stack; otherwise v and up compute their stacks again
    assert len(calls) == (2 if shared else 4)
    assert all(layer.shared.last is None for layer in traced.modules()
               if isinstance(layer, TracedLinear))  # the last sibling dropped the product


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 24), (1, 1, 24), (3, 5, 24)])
def test_a_traced_layer_without_a_stack_matches_f_linear_compiled(bias, shape):
    torch.manual_seed(0)
    linear = torch.nn.Linear(24, 40, bias=bias)
    traced = torch.compile(TracedLinear(linear), dynamic=True)
    x = torch.randn(shape)
    with torch.inference_mode():
        torch.testing.assert_close(traced(x), linear(x), rtol=1e-5, atol=1e-5)


def streamed_or_skip():
    if not streamed_available(torch.float32):
        pytest.skip("the streamed kernel needs AVX-512 or AVX2 and a build")


@pytest.mark.parametrize("rows", [0, 1, 2, 9, 14, 15, 17, 18, 35, 100])  # 0: an empty feed
@pytest.mark.parametrize("out_features", [16, 40, 1000])
@pytest.mark.parametrize("stored", [None, torch.float16, torch.int8])
def test_streamed_products_match_f_linear_for_any_rows_and_sizes(rows, out_features, stored):
    streamed_or_skip()
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 72), torch.randn(out_features, 72), torch.randn(
        out_features)
    # a narrow copy: the weight rounded once (8 bits: integers times each output's scale), the
    # products added in float32
    scale = None
    if stored == torch.int8:
        integers, scale = quantized(weight)
        packed, rounded = pack_streamed(integers), integers.float() * scale[:, None]
    else:
        packed = pack_streamed(weight, stored)
        rounded = weight.to(stored).float() if stored else weight
    assert packed.shape == (-(-out_features // 16), 72, 16)  # padded to whole blocks
    assert packed.dtype == (stored or torch.float32)
    torch.testing.assert_close(streamed_linear(x, packed, out_features, bias, scale),
                               torch.nn.functional.linear(x, rounded, bias), rtol=1e-5,
                               atol=1e-4)


def test_an_8_bit_copy_keeps_each_weight_within_half_a_step_of_its_rows_scale():
    torch.manual_seed(0)
    weight = torch.cat([torch.randn(40, 72), torch.zeros(1, 72)])
    integers, scale = quantized(weight)
    assert integers.dtype == torch.int8 and integers[:40].abs().amax(1).eq(127).all()
    assert not integers[40].any() and scale.gt(0).all()  # a zero row: no division by zero
    rounded = integers.float() * scale[:, None]
    assert ((rounded - weight).abs() <= scale[:, None] / 2 * (1 + 1e-5)).all()


@pytest.mark.parametrize(("stored", "share"), [(torch.float16, 2), (torch.int8, 4)])
def test_a_narrow_stack_streams_every_row_count_from_fewer_bytes(stored, share):
    # BLAS would read the float32 weight: single rows and prompts take the narrow copy too
    streamed_or_skip()
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48)
    stack = LinearStack([linear], stored=stored)
    assert stack.nbytes == LinearStack([linear]).nbytes // share

    def expected(x: torch.Tensor) -> torch.Tensor:
        if stored == torch.int8:
            integers, scale = quantized(linear.weight)
            return streamed_linear(x, pack_streamed(integers), 48, linear.bias, scale)
        return streamed_linear(x, pack_streamed(linear.weight, stored), 48, linear.bias)

    with torch.inference_mode():
        for rows in (1, 3, 300):
            x = torch.randn(rows, 64)
            assert torch.equal(stack.forward(0, x), expected(x))
        with torch.no_grad():
            linear.weight.mul_(3)  # a changed weight is packed again, its scales too
        stack.refresh()
        x = torch.randn(3, 64)
        assert torch.equal(stack.forward(0, x), expected(x))


# 576 inputs: 40 rows are three chunks of one group; 1,536 inputs: two chunks a group, so a
# 200-row prompt passes the blocks in six groups
@pytest.mark.parametrize(("rows", "inputs"), [(40, 576), (200, 1536)])
def test_a_streamed_row_does_not_depend_on_the_rows_beside_it(rows, inputs):
    streamed_or_skip()
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, inputs), torch.randn(48, inputs)
    packed = pack_streamed(weight)
    together = streamed_linear(x, packed, 48)
    torch.testing.assert_close(together, torch.nn.functional.linear(x, weight), rtol=1e-5,
                               atol=1e-3)
    alone = torch.cat([streamed_linear(row[None], packed, 48) for row in x])
    assert torch.equal(together, alone)  # bit for bit: a tree's logits are one-token steps'


@pytest.mark.parametrize("rows", [1, 9, 17])
@pytest.mark.parametrize("stored", [None, torch.float16, torch.int8])
def test_an_output_has_the_same_bits_whichever_block_it_is_paired_with(rows, stored):
    # AVX-512 goes past blocks in pairs: outputs 16-31 paired with 0-15 here, with 32-47 there
    streamed_or_skip()
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 96), torch.randn(48, 96)
    if stored == torch.int8:  # each output's integers and scale are its own row's
        weight, stored = quantized(weight)[0], None
    whole = streamed_linear(x, pack_streamed(weight, stored), 48)
    shifted = streamed_linear(x, pack_streamed(weight[16:], stored), 32)
    alone = streamed_linear(x, pack_streamed(weight[16:32], stored), 16)
    assert torch.equal(whole[:, 16:32], shifted[:, :16])
    assert torch.equal(whole[:, 16:32], alone)


def test_a_streamed_product_compiles_into_one_graph_with_the_same_bits():
    # an operator with its output's shape: inductor calls the C++ kernel from its own code
    streamed_or_skip()
    torch.manual_seed(0)
    x, weight, bias = torch.randn(17, 72), torch.randn(40, 72), torch.randn(40)
    packed = pack_streamed(weight)
    compiled = torch.compile(lambda rows: streamed_linear(rows, packed, 40, bias),
                             fullgraph=True, dynamic=True)
    for rows in (2, 17):
        assert torch.equal(compiled(x[:rows]), streamed_linear(x[:rows], packed, 40, bias))


def test_probing_the_streamed_kernel_leaves_torchs_global_rng_alone():
    streamed_available.cache_clear()  # probed again, as in a new process
    state = torch.get_rng_state()
    try:
        streamed_available(torch.float32)
    finally:
        streamed_available.cache_clear()
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("cpu", ["DEFAULT", "AVX2 that cannot build",
                                 "AVX512 that cannot build"])
@pytest.mark.parametrize("kernel", ["streamed product", "attention"])
def test_our_cpu_kernels_are_offered_where_their_instructions_are_and_they_build(
        kernel, cpu, monkeypatch, caplog):
    import rag_spec_kernels.cpu_attention as attention
    import rag_spec_kernels.streamed as streamed

    assert not streamed_available(torch.bfloat16)
    module, probe = ((streamed, streamed_available) if kernel == "streamed product"
                     else (attention, attention.cpu_attention_available))
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: cpu.split()[0])

    def no_compiler():
        msg = "gcc: not found"
        raise RuntimeError(msg)

    monkeypatch.setattr(module, "cpu_extension", no_compiler)
    probe.cache_clear()
    try:
        assert not (streamed_available(torch.float32) if module is streamed else probe())
        if module is attention:
            query, key = torch.zeros(1, 2, 1, 16), torch.zeros(1, 1, 3, 16)
            assert not attention.cpu_attention_fits(query, key)  # steps attend through SDPA
    finally:
        probe.cache_clear()
    # a build is tried (and its failure said) on AVX-512, and on AVX2 for the streamed product
    tried = cpu.startswith("AVX512") or cpu.startswith("AVX2") and module is streamed
    assert ("gcc: not found" in caplog.text) == tried


def test_a_lock_a_killed_build_left_does_not_stall_the_next_process(tmp_path, monkeypatch):
    """torch's extension loader waits forever on the lock file of a process killed while it
    built or checked the kernels; under our own lock (dropped when its holder dies) the
    leftover is removed before torch looks."""
    import torch.utils.cpp_extension as extension

    import rag_spec_kernels.cpu_extension as builder

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / f"rag_spec_cpu_kernels_avx2-torch{torch.__version__}"
    build.mkdir()
    (build / "lock").write_text("")  # left by a killed process
    seen = []
    monkeypatch.setattr(extension, "load",
                        lambda **kwargs: seen.append((build / "lock").exists()))
    builder.cpu_extension.__wrapped__()
    assert seen == [False]



def test_kernels_a_killed_build_left_unreadable_are_built_again(tmp_path, monkeypatch, capsys):
    import torch.utils.cpp_extension as extension

    import rag_spec_kernels.cpu_extension as builder

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    build = tmp_path / f"rag_spec_cpu_kernels_avx2-torch{torch.__version__}"
    build.mkdir()
    for output in ("rag_spec_cpu_kernels_avx2.so", "bindings.o", "build.ninja"):
        (build / output).write_bytes(b"cut short")
    loads = []

    def load(**kwargs):
        loads.append(sorted(path.name for path in build.iterdir()))
        if len(loads) == 1:
            msg = "rag_spec_cpu_kernels_avx2.so: invalid ELF header"
            raise OSError(msg)

    monkeypatch.setattr(extension, "load", load)
    builder.cpu_extension.__wrapped__()
    assert loads == [["bindings.o", "build.ninja", "rag-spec.lock", "rag_spec_cpu_kernels_avx2.so"],
                     ["rag-spec.lock"]]  # built again from the sources
    assert "could not be loaded" in capsys.readouterr().err



@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moved_slots_match_torchs_gather_in_every_tensor_of_a_step(dtype, kernel, monkeypatch):
    # two rows: one keeps four slots, one keeps two (padded with its last, as keep_slots pads),
    # and slots out of order read before any is written; keys as prefix views of a wider slab;
    # the C++ kernel and torch's operations where it is not built
    if kernel and not slots_kernel_available():
        pytest.skip("the CPU kernels need AVX-512 or AVX2 and a build")
    monkeypatch.setattr(slot_kernel, "slots_kernel_available", lambda: kernel)
    torch.manual_seed(0)
    slabs = [torch.randn(2, 3, 40, 8).to(dtype) for _ in range(4)]
    views = [slab[:, :, :30] for slab in slabs]
    index = torch.tensor([[0, 2, 5, 6], [1, 3, 3, 3]]) + 20
    shuffled = torch.tensor([[3, 0, 2, 1], [2, 2, 0, 1]]) + 20
    for slots in (index, shuffled):
        expected = [view.clone() for view in views]
        for tensor in expected:
            gather = slots[:, None, :, None].expand(-1, 3, -1, 8)
            tensor[:, :, 20:24] = tensor.gather(2, gather)
        move_slots(views, slots, 20)
        for view, want in zip(views, expected):
            assert torch.equal(view, want)
    for wrong in (31, -21):  # past the views' 30 slots; before the first
        with pytest.raises(RuntimeError, match="out of range" if kernel else "index"):
            move_slots(views, torch.tensor([[0, wrong, 2, 3], [0, 1, 2, 3]]) + 20, 20)
