"""Quantised weights kept as a GGUF file holds them: the kernel that multiplies by them (every
row as it would be alone), the reader that converts a file's blocks, and the decoder on them."""

import numpy as np
import pytest
import torch

from rag_spec_kernels import (
    GroupQuantized,
    LinearStack,
    TracedLinear,
    linear_stacks,
    pack_quantized,
    quantized_available,
    quantized_linear,
    quantized_reference,
    stacked,
)
from rag_spec_kernels.quantized import stackable


def kernel_or_skip():
    if not quantized_available():
        pytest.skip("the quantised kernel needs AVX-512 or AVX2 and a build")


def random_weight(out, inputs, bits, minimum=True, seed=0, group=32, factored=False):
    """Random values, scales and minimums: half-precision scales, or (``factored``, the
    K-quants' form) int8 ones times a factor per 256 inputs."""
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randint(0, 16, (out, inputs), generator=generator, dtype=torch.uint8)
              if bits == 4 else
              torch.randint(-128, 128, (out, inputs), generator=generator, dtype=torch.int8))
    if factored:
        def factors(sign):
            spread = torch.rand(out, inputs // 256, generator=generator) * 3e-4
            return (sign * spread).half().float()

        scales = torch.randint(-128, 128, (out, inputs // group), generator=generator,
                               dtype=torch.int8)
        mins = (torch.randint(0, 64, (out, inputs // group), generator=generator,
                              dtype=torch.int8) if minimum else None)
        return GroupQuantized(values, scales, mins, bits, group, factors(1),
                              factors(-1) if minimum else None)
    scales = (torch.rand(out, inputs // group, generator=generator) * 0.02).half()
    mins = ((-torch.rand(out, inputs // group, generator=generator) * 0.1).half()
            if minimum else None)
    return GroupQuantized(values, scales, mins, bits, group)


# the legacy formats' forms (Q4_0 and Q4_1, Q8_0, mixed siblings), then the K-quants' (Q4_K,
# Q6_K widened): integer scales with factors, groups of 16
FORMS = [(4, True, 32, False), (8, False, 32, False), (8, True, 32, False),
         (4, True, 32, True), (8, False, 16, True)]


@pytest.mark.parametrize("rows", [0, 1, 2, 6, 7, 13, 16, 17, 40, 130])  # 0: an empty feed
@pytest.mark.parametrize("out_features", [16, 40, 1000])
@pytest.mark.parametrize(("bits", "minimum", "group", "factored"), FORMS)
def test_quantized_products_are_the_reference_product_on_8_bit_inputs(rows, out_features, bits,
                                                                     minimum, group, factored):
    kernel_or_skip()
    torch.manual_seed(rows)
    weight = random_weight(out_features, 512, bits, minimum, group=group, factored=factored)
    x, bias = torch.randn(rows, 512), torch.randn(out_features)
    packed = pack_quantized(weight)
    assert packed[0].shape == (-(-out_features // 8), 512 // (8 if bits == 4 else 4), 32)
    y = quantized_linear(x, packed, out_features, bias)
    torch.testing.assert_close(y, (quantized_reference(x, weight) + bias).float(),
                               rtol=1e-5, atol=1e-4)
    # and near the float32 product: the inputs' rounding, a few parts in a thousand
    exact = torch.nn.functional.linear(x, weight.dequantized(), bias)
    assert (y - exact).norm() <= 0.02 * exact.norm()


def test_inputs_too_small_or_not_finite_do_not_break_the_product():
    kernel_or_skip()
    weight = random_weight(16, 64, 4)
    x = torch.randn(4, 64)
    x[0, :32] = 1e-41  # a scale that cannot be inverted: the group counts as zero
    x[1, :32] = 0.0
    x[2, 5] = float("inf")
    x[3, 40] = float("nan")
    y = quantized_linear(x, pack_quantized(weight), 16)
    reference = quantized_reference(x[:2], weight).float()
    torch.testing.assert_close(y[:2], reference, rtol=1e-5, atol=1e-4)
    assert not y[2:].isfinite().any()


@pytest.mark.parametrize("rows", [13, 40, 200])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 16])
def test_a_quantized_row_does_not_depend_on_the_rows_beside_it(rows, bits, group):
    # bit for bit: a verified tree's logits are one-token steps' on these weights too
    kernel_or_skip()
    torch.manual_seed(rows)
    weight = random_weight(48, 768, bits, group=group, factored=group == 16)
    x, packed = torch.randn(rows, 768), pack_quantized(weight)
    together = quantized_linear(x, packed, 48)
    alone = torch.cat([quantized_linear(row[None], packed, 48) for row in x])
    assert torch.equal(together, alone)
    # and whichever block an output is in
    shifted = weight.taken(torch.arange(8, 48))
    assert torch.equal(together[:, 8:], quantized_linear(x, pack_quantized(shifted), 40))


def test_a_k_quants_integer_scales_are_their_products_exactly():
    # 6-bit scales times a half-precision factor: exact in float32, the product's bits
    weight = random_weight(8, 512, 4, factored=True)
    scales, mins = weight.scaling(torch.float32)
    expected = weight.scales.double() * weight.scale_factors.double().repeat_interleave(8, 1)
    assert torch.equal(scales.double(), expected) and mins is not None
    packed = pack_quantized(weight)
    assert packed[1].dtype == torch.int8 and packed[3].shape == (1, 2, 16)


def test_dequantizing_rounds_each_weight_once():
    # value * scale + minimum, exactly, then one rounding to float32
    weight = GroupQuantized(torch.tensor([[3] * 32], dtype=torch.uint8),
                            torch.tensor([[0.1]]).half(), torch.tensor([[-0.7]]).half(), 4)
    exact = 3 * float(torch.tensor(0.1).half()) + float(torch.tensor(-0.7).half())
    assert weight.dequantized()[0, 0].item() == np.float32(exact)


def test_siblings_of_both_widths_stack_as_8_bits_with_zero_minimums():
    four, eight = random_weight(16, 64, 4), random_weight(32, 64, 8, minimum=False)
    both = stacked([four, eight])
    assert both.bits == 8 and both.values.dtype == torch.int8 and both.shape == (48, 64)
    assert torch.equal(both.dequantized(), torch.cat([four.dequantized(), eight.dequantized()]))
    # K-quants of both widths stack too, their factors side by side
    k_four = random_weight(16, 256, 4, factored=True)
    k_eight = random_weight(8, 256, 8, minimum=False, factored=True, seed=1)
    k_both = stacked([k_four, k_eight])
    assert k_both.scales.dtype == torch.int8 and torch.equal(
        k_both.dequantized(), torch.cat([k_four.dequantized(), k_eight.dequantized()]))
    # groups of 16 beside groups of 32, or integer scales beside half-precision ones, cannot be
    # one product: their layers multiply alone
    sixteen = random_weight(16, 256, 8, minimum=False, group=16, factored=True)
    assert not stackable([k_eight, sixteen]) and not stackable([four, k_four])
    with pytest.raises(ValueError, match="groups, or their kinds of scales, differ"):
        stacked([k_eight, sixteen])
    q, v = torch.nn.Linear(256, 16, bias=False), torch.nn.Linear(256, 16, bias=False)
    parent = torch.nn.Module()
    parent.q_proj, parent.k_proj, parent.v_proj = q, torch.nn.Linear(256, 8, bias=False), v
    blocks = {"q_proj": random_weight(16, 256, 4), "k_proj": k_eight, "v_proj": sixteen}
    found = linear_stacks(parent, {id(m) for m in parent.children()}, blocks=blocks)
    assert sorted(len(stack.sizes) for _, _, stack, _ in found) == [1, 1, 1]


def test_a_badly_shaped_weight_is_refused_with_its_shapes():
    with pytest.raises(ValueError, match=r"multiple of the group .* got \(4, 40\), \(4, 1\)"):
        GroupQuantized(torch.zeros(4, 40, dtype=torch.uint8), torch.zeros(4, 1).half(), None, 4)
    with pytest.raises(ValueError, match="minimums alike"):  # scales and minimums disagree
        GroupQuantized(torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 1),
                       torch.zeros(4, 1).half(), 4)
    with pytest.raises(ValueError, match="group 8"):
        GroupQuantized(torch.zeros(4, 32, dtype=torch.int8), torch.zeros(4, 4), None, 8, 8)
    with pytest.raises(ValueError, match="factors"):  # half-precision scales take no factors
        GroupQuantized(torch.zeros(4, 256, dtype=torch.int8), torch.zeros(4, 8).half(), None,
                       8, 32, torch.ones(4, 1))
    with pytest.raises(ValueError, match=r"factors None"):  # integer ones need theirs
        GroupQuantized(torch.zeros(4, 256, dtype=torch.int8),
                       torch.zeros(4, 8, dtype=torch.int8), None, 8)


def test_a_quantized_stack_multiplies_every_row_count_by_the_files_weights():
    kernel_or_skip()
    torch.manual_seed(0)
    q, k = torch.nn.Linear(64, 32), torch.nn.Linear(64, 16, bias=False)
    blocks = [random_weight(32, 64, 4, seed=1), random_weight(16, 64, 8, minimum=False, seed=2)]
    stack = LinearStack([q, k], blocks=blocks)
    # one kernel call for both: the 4-bit values widened to 8 bits, scales and minimums halves
    assert stack.quantized and stack.nbytes == 48 * 64 + 2 * (48 * 2 * 2)
    with torch.inference_mode():
        for rows in (1, 5, 300):  # single rows too: BLAS would read the float32 weight
            x = torch.randn(rows, 64)
            expected = quantized_reference(x, stacked(blocks)).float() + torch.cat(
                [q.bias, torch.zeros(16)])
            torch.testing.assert_close(stack.product(x), expected, rtol=1e-5, atol=1e-4)
            # a traced layer (compiled steps) calls the same kernel on the same tensors
            traced = stack.traced_modules()
            assert torch.equal(traced[0](x), stack.forward(0, x))
            assert isinstance(traced[1], TracedLinear)
            # a sibling handed an input of its own: its outputs alone, the same numbers
            assert torch.equal(stack.forward(1, x), stack.product(x)[:, 32:])
            assert torch.equal(stack.forward(1, x), quantized_linear(
                x, pack_quantized(blocks[1]), 16))


# -- a GGUF file's blocks ------------------------------------------------------------------


@pytest.fixture
def gguf_file(tmp_path):
    """A GGUF file with a two-layer Llama's query (Q4_0) and key (Q4_1), their rows permuted as
    llama.cpp's converter writes them, a down projection (Q8_0) and a tensor in a format the
    reader does not convert (F16), written by gguf-py."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    weights = {"blk.0.attn_q.weight": (rng.standard_normal((64, 64)), "Q4_0"),
               "blk.0.attn_k.weight": (rng.standard_normal((32, 64)), "Q4_1"),
               "blk.1.ffn_down.weight": (rng.standard_normal((64, 96)), "Q8_0"),
               "blk.1.ffn_up.weight": (rng.standard_normal((96, 64)), "F16")}
    writer = gguf.GGUFWriter(str(tmp_path / "tiny.gguf"), "llama")
    for name, (weight, kind) in weights.items():
        kind = gguf.GGMLQuantizationType[kind]
        data = weight.astype(np.float32)
        if ".attn_" in name:  # llama.cpp's permutation of rows: 4 query, 2 key heads
            heads = data.shape[0] // 16
            data = data.reshape(heads, 2, 8, 64).swapaxes(1, 2).reshape(-1, 64)
        writer.add_tensor(name, quantize(data, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp_path / "tiny.gguf", weights


def test_a_files_q4_0_q4_1_and_q8_0_blocks_convert_exactly_in_transformers_row_order(
        gguf_file, caplog):
    import gguf as gguf_py
    from gguf.quants import dequantize, quantize

    from rag_spec.target.gguf import read_weights

    path, weights = gguf_file
    config = type("Config", (), {"model_type": "llama", "num_attention_heads": 4,
                                 "num_key_value_heads": 2})()
    with caplog.at_level("INFO"):
        read = read_weights(path, config)
    assert set(read) == {"model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj",
                         "model.layers.1.mlp.down_proj"}
    assert "F16 layers of tiny.gguf have no quantised kernel yet" in caplog.text
    for name, module in (("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj"),
                         ("blk.0.attn_k.weight", "model.layers.0.self_attn.k_proj"),
                         ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj")):
        weight, kind = weights[name]
        kind = gguf_py.GGMLQuantizationType[kind]
        # rows are quantised apart: the file's permuted rows, put back, are these
        data = dequantize(quantize(weight.astype(np.float32), kind), kind)
        # gguf-py de-quantises with two roundings, the kernel's weights with one
        torch.testing.assert_close(read[module].dequantized(), torch.from_numpy(data),
                                   rtol=1e-6, atol=1e-6)
    assert read["model.layers.0.self_attn.k_proj"].bits == 4
    assert read["model.layers.1.mlp.down_proj"].bits == 8


def k_quant_blocks(rows, inputs, kind, seed=0, spread=0.3):
    """Random Q4_K or Q6_K blocks for a (rows, inputs) weight (gguf-py quantises neither):
    any bytes are a block, but for its half-precision scales, set small and positive here, the
    weights about ``spread`` wide and centred."""
    rng = np.random.default_rng(seed)
    size = {"Q4_K": 144, "Q6_K": 210}[kind]
    raw = rng.integers(0, 256, (rows, inputs // 256, size), dtype=np.uint8)

    def halves(scale):
        return (rng.random((rows, inputs // 256)) * scale).astype(np.float16).view(
            np.uint8).reshape(rows, -1, 2)

    if kind == "Q4_K":  # d * scale * value - dmin * minimum: 6-bit scales, 4-bit values
        raw[..., 0:2] = halves(spread / (63 * 15))
        raw[..., 2:4] = halves(spread / 63)
    else:  # d * scale * value: signed 8-bit scales, 6-bit values less 32
        raw[..., 208:210] = halves(spread / (127 * 32))
    return raw.reshape(rows, -1)


def test_a_files_q4_k_and_q6_k_blocks_convert_exactly_and_other_formats_are_named(tmp_path,
                                                                                  caplog):
    """The K-quants most files hold: Q4_K as 4-bit values with single-precision scales and
    minimums per 32, Q6_K's 6-bit values widened to 8 bits with a scale per 16; exactly what
    gguf-py (transformers' loader) de-quantises them to. Q5_K has no kernel: float32."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    from rag_spec.target.gguf import read_weights

    query = k_quant_blocks(64, 256, "Q4_K")  # transformers' row order
    # llama.cpp's row order (4 heads): rows are quantised apart, so their blocks move whole
    stored = query.reshape(4, 2, 8, -1).swapaxes(1, 2).reshape(query.shape)
    down = k_quant_blocks(32, 512, "Q6_K", seed=1)
    kinds = gguf.GGMLQuantizationType
    writer = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    writer.add_tensor("blk.0.attn_q.weight", stored, raw_dtype=kinds.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", down, raw_dtype=kinds.Q6_K)
    writer.add_tensor("blk.0.ffn_up.weight", np.zeros((512, 176), dtype=np.uint8),
                      raw_dtype=kinds.Q5_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    config = type("Config", (), {"model_type": "llama", "num_attention_heads": 4,
                                 "num_key_value_heads": 2})()
    with caplog.at_level("INFO"):
        read = read_weights(tmp_path / "k.gguf", config)
    q, d = read["model.layers.0.self_attn.q_proj"], read["model.layers.0.mlp.down_proj"]
    assert set(read) == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}
    assert (q.bits, q.group, q.scales.dtype) == (4, 32, torch.int8) and q.mins is not None
    assert (d.bits, d.group, d.scales.dtype, d.mins) == (8, 16, torch.int8, None)
    assert q.scale_factors.shape == q.min_factors.shape == (64, 1)  # one a super-block
    assert torch.equal(q.dequantized(), torch.from_numpy(dequantize(query, kinds.Q4_K)))
    assert torch.equal(d.dequantized(), torch.from_numpy(dequantize(down, kinds.Q6_K)))
    assert "Q5_K layers of k.gguf have no quantised kernel yet" in caplog.text
    assert "the Q6_K layers of k.gguf run on the 8-bit kernel (6-bit values widened)" in \
        caplog.text


# -- the decoder on a file's weights -------------------------------------------------------


def quantized_copy(lm, folder, k_quants=False):
    """A copy of ``lm`` whose layers hold what a GGUF file of them de-quantises to (Q4_1
    layers, a Q8_0 head; with ``k_quants``, Q4_K_M's mix: Q4_K layers, Q6_K down projections
    and head, random blocks; rows permuted as llama.cpp's converter writes them), loaded "from"
    that file, as ``load_model("x.gguf")`` leaves a model."""
    import copy

    import gguf
    from gguf.quants import dequantize, quantize

    from rag_spec.models import LoadedModel
    from rag_spec.target.gguf import remember_file

    model = copy.deepcopy(lm.model)
    config = model.config
    writer = gguf.GGUFWriter(str(folder / "tiny.gguf"), "llama")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    with torch.no_grad():
        for path, module in model.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            if path == "lm_head":
                name, kind = "output.weight", gguf.GGMLQuantizationType.Q8_0
            else:
                layer, sub = path.removeprefix("model.layers.").split(".", 1)
                name, kind = f"blk.{layer}.{names[sub]}.weight", gguf.GGMLQuantizationType.Q4_1
            if k_quants:
                kind = gguf.GGMLQuantizationType[
                    "Q6_K" if path == "lm_head" or "down_proj" in path else "Q4_K"]
                blocks = k_quant_blocks(*module.weight.shape, kind.name, seed=len(path))
            else:
                blocks = quantize(module.weight.numpy(), kind)
            stored = blocks  # rows are quantised apart: they move whole
            if names.get(path.split(".", 3)[-1]) in ("attn_q", "attn_k"):
                heads = (config.num_attention_heads if path.endswith("q_proj")
                         else config.num_key_value_heads)
                stored = blocks.reshape(heads, 2, -1, blocks.shape[1]).swapaxes(1, 2).reshape(
                    blocks.shape)
            writer.add_tensor(name, stored, raw_dtype=kind)
            module.weight.copy_(torch.from_numpy(dequantize(blocks, kind)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    remember_file(model, folder / "tiny.gguf")
    return LoadedModel(model, lm.tokenizer, "tiny.gguf", lm.device, lm.dtype)


def test_a_files_converted_blocks_are_kept_and_a_damaged_copy_is_read_again(tmp_path,
                                                                             monkeypatch):
    """gguf's reader parses the whole vocabulary first (seconds a process): later reads of
    the same file load its converted blocks from rag-spec's cache instead."""
    from test_entry_matrix import char_lm

    import rag_spec.target.gguf as gguf_module
    from rag_spec.target.gguf import read_weights, source_file

    lm = quantized_copy(char_lm(), tmp_path)
    path, config = source_file(lm.model), lm.model.config
    first = read_weights(path, config)
    converted = gguf_module._converted
    monkeypatch.setattr(gguf_module, "_converted", lambda *a: pytest.fail("read again"))
    kept = read_weights(path, config)
    assert kept.keys() == first.keys() and all(
        torch.equal(kept[m].values, first[m].values) and torch.equal(kept[m].scales,
                                                                     first[m].scales)
        and kept[m].bits == first[m].bits for m in first)
    copy = gguf_module._kept_path(path, config)
    copy.write_bytes(b"damaged")
    monkeypatch.setattr(gguf_module, "_converted", converted)
    again = read_weights(path, config)
    assert again.keys() == first.keys() and copy.stat().st_size > 100  # written afresh


@pytest.fixture(scope="module")
def quantized_lm(tmp_path_factory):
    from test_entry_matrix import char_lm

    return quantized_copy(char_lm(window=1024), tmp_path_factory.mktemp("gguf"))


def test_a_model_from_a_q4_k_m_file_decodes_from_its_blocks_as_its_own_one_token_steps(
        tmp_path):
    """Q4_K_M, the files most users have: every layer on the kernel (Q4_K's, Q6_K's widened),
    drafted answers equal to the one-token decoding of the same weights."""
    from test_entry_matrix import N, prompts

    from conftest import char_tokenizer, tiny_llama
    from rag_spec import LookaheadConfig, LookaheadDecoder, TrieDrafter
    from rag_spec.models import LoadedModel

    kernel_or_skip()
    tokenizer = char_tokenizer()  # K-quants' blocks are 256 wide: a model 256 wide
    wide = LoadedModel(tiny_llama(vocab_size=len(tokenizer), window=1024, hidden=256),
                       tokenizer, "tiny", torch.device("cpu"), torch.float32)
    lm = quantized_copy(wide, tmp_path, k_quants=True)
    plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0, quantized=True,
                                                                     compile=False))
    drafted = LookaheadDecoder(lm.model, lm.tokenizer,
                               LookaheadConfig(budget=8, quantized=True, compile=False),
                               drafter=TrieDrafter())
    stacks = drafted.runner.stacks
    assert stacks and all(stack.quantized for stack in stacks)
    assert {stack._packed[0][1].dtype for stack in stacks} == {torch.int8}  # the K-quants'
    one, two = prompts(lm)
    expected = [plain.generate(p, N).token_ids for p in (one, two)]
    assert [r.token_ids for r in drafted.generate([one, two], N)] == expected


@pytest.mark.parametrize("drafter", ["trie", "head+trie", "draft model", "early exit",
                                     "self-spec"])
def test_every_drafter_on_a_files_weights_equals_its_own_one_token_decoding(
        drafter, quantized_lm):
    from test_entry_matrix import DRAFTERS, TEXTS, N, prompts

    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.training.train_head import train_head

    kernel_or_skip()
    lm = quantized_lm
    head = None
    if "head" in drafter:
        sequences = [lm.tokenizer(text * 4)["input_ids"] for text in TEXTS * 6]
        head = train_head(lm.model, sequences, vocabulary=24, epochs=1, lr=5e-3, progress=False)
    plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0, quantized=True,
                                                                     compile=False))
    drafted = LookaheadDecoder(lm.model, lm.tokenizer,
                               LookaheadConfig(budget=8, quantized=True, compile=False),
                               drafter=DRAFTERS[drafter](lm, head))
    assert all(stack.quantized for stack in drafted.runner.stacks)
    one, two = prompts(lm)
    expected = [plain.generate(p, N).token_ids for p in (one, two)]
    assert [r.token_ids for r in drafted.generate([one, two], N)] == expected
    assert drafted.generate(one[:1], N).token_ids == plain.generate(one[:1], N).token_ids
    # another function than the float32 layers': rounded inputs
    float32 = LookaheadDecoder(lm.model, lm.tokenizer,
                               LookaheadConfig(budget=0, compile=False, quantized=False))
    assert not any(stack.quantized for stack in float32.runner.stacks)


def test_on_a_files_weights_a_padded_batch_prefill_answers_as_each_prompt_alone(
        quantized_lm, monkeypatch):
    """Inputs rounded to 8 bits turn the smallest rounding difference into other tokens (the
    embedded model answered 4 of 8 RAG prompts otherwise in a batch when the prefill attended
    on SDPA): every pass attends row by row, so a padded batch's prefill gives each prompt the
    entries of its own pass."""
    from test_entry_matrix import N, prompts

    import rag_spec.target.transformers.prefill as prefill_module
    from rag_spec import LookaheadConfig, LookaheadDecoder

    kernel_or_skip()
    lm = quantized_lm
    decoder = LookaheadDecoder(lm.model, lm.tokenizer,  # no stored prefixes: every prompt runs
                               LookaheadConfig(quantized=True, compile=False, prefix_cache_mb=0))
    assert decoder.runner.row_invariant
    one, two = prompts(lm)
    ragged = [one, one[:len(one) - 9], one[:5]]
    alone = [decoder.generate(p, N).token_ids for p in ragged]
    passes = []
    fill = prefill_module.fill
    monkeypatch.setattr(prefill_module, "fill", lambda runner, tree, ids: passes.append(
        (ids.shape[0], bool(tree.valid.all()))) or fill(runner, tree, ids))
    assert [r.token_ids for r in decoder.generate(ragged, N)] == alone
    assert (3, False) in passes  # one padded pass for the three


def test_by_default_a_model_from_a_gguf_file_decodes_its_blocks_and_any_other_float32(
        quantized_lm, caplog):
    """``quantized="auto"``: the file's blocks where they apply, silently float32 elsewhere
    (another model, exact numerics), where ``True`` would refuse or say why."""
    from test_entry_matrix import char_lm

    from rag_spec import LookaheadConfig, LookaheadDecoder

    kernel_or_skip()
    lm = quantized_lm
    default = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(compile=False))
    result = default.generate([1, 2, 3], 4)
    assert result.stats.weights == "GGUF"
    assert default.runner.stacks and all(s.quantized for s in default.runner.stacks)
    plain = LookaheadDecoder(lm.model, lm.tokenizer,
                             LookaheadConfig(budget=0, quantized=True, compile=False))
    assert result.token_ids == plain.generate([1, 2, 3], 4).token_ids
    exact = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(exact=True, compile=False))
    assert exact.generate([1, 2, 3], 4).stats.weights == "float32"  # no error: not applicable
    other = char_lm()
    with caplog.at_level("INFO"):
        fresh = LookaheadDecoder(other.model, other.tokenizer, LookaheadConfig(compile=False))
        assert fresh.generate([1, 2, 3], 2).stats.weights == "float32"
    assert "was not loaded from a GGUF file" not in caplog.text  # nothing asked, nothing said


def test_quantized_needs_a_float32_model_without_exact_numerics(quantized_lm):
    from rag_spec import LookaheadConfig, LookaheadDecoder, RagSpecError

    with pytest.raises(RagSpecError, match="in float32 arithmetic, without exact numerics"):
        LookaheadDecoder(quantized_lm.model, quantized_lm.tokenizer,
                         LookaheadConfig(quantized=True, exact=True, compile=False))


def test_a_model_loaded_from_no_file_decodes_in_float32_saying_so(caplog):
    from test_entry_matrix import char_lm

    from rag_spec import LookaheadConfig, LookaheadDecoder

    lm = char_lm()
    with caplog.at_level("INFO"):
        decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(quantized=True,
                                                                           compile=False))
        decoder.generate([1, 2, 3], 2)
    assert "was not loaded from a GGUF file" in caplog.text
    assert not any(stack.quantized for stack in decoder.runner.stacks)


@pytest.mark.slow
@pytest.mark.e2e
def test_the_embedded_gguf_file_loads_with_its_chat_template_and_decodes_from_its_blocks(
        user_cache):
    import rag_spec
    from rag_spec.target.gguf import source_file

    kernel_or_skip()
    embedded = rag_spec.load_model()
    path = source_file(embedded.model)  # the pull keeps the file beside the float32 weights
    assert path is not None and path.is_file()
    lm = rag_spec.load_model(str(path))
    messages = [{"role": "user", "content": "What is a Python list?"}]
    ids = rag_spec.chat_input_ids(lm.tokenizer, messages)
    # the file's chat template (transformers' GGUF tokenizer leaves it out): the same prompt
    assert ids == rag_spec.chat_input_ids(embedded.tokenizer, messages)
    for model in (lm, embedded):
        config = rag_spec.LookaheadConfig
        drafted = rag_spec.LookaheadDecoder(model.model, model.tokenizer,
                                            config(quantized=True))
        plain = rag_spec.LookaheadDecoder(model.model, model.tokenizer,
                                          config(quantized=True, budget=0))
        assert all(stack.quantized for stack in drafted.runner.stacks)
        result = drafted.generate(ids, max_new_tokens=24)
        assert result.token_ids == plain.generate(ids, max_new_tokens=24).token_ids
        assert result.text.strip()  # an answer, not an end token at once


@pytest.mark.e2e
def test_on_the_embedded_files_weights_a_ragged_batch_answers_as_each_prompt_alone(user_cache):
    """Held-out RAG prompts of several lengths, decoded in one batch and joining a batch in
    flight, against each alone (the embedded model, its GGUF blocks)."""
    import rag_spec
    from rag_spec.bench.prompts import HELD_OUT_RAG_QUESTIONS

    kernel_or_skip()
    lm = rag_spec.load_model()
    questions = list(HELD_OUT_RAG_QUESTIONS)[:4]
    hits = rag_spec.KnowledgeBase.load_default("flat").search(questions, k=3)
    prompts = [rag_spec.chat_input_ids(lm.tokenizer, rag_spec.rag_messages(q, h))
               for q, h in zip(questions, hits)]
    decoder = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer)
    assert decoder.runner.weights == "GGUF"
    alone = [decoder.generate(p, 40).token_ids for p in prompts]
    assert [r.token_ids for r in decoder.generate(prompts, 40)] == alone
    batch = decoder.open_batch()
    try:
        rows = []
        for prompt in prompts:  # one joins every other step
            rows += decoder.new_rows(prompt, 40)
            batch.join(rows[-1:])
            batch.step()
            batch.step()
        while batch.live:
            batch.step()
    finally:
        batch.close()
    assert [r.result().token_ids for r in rows] == alone


def test_a_layer_changed_since_loading_keeps_its_float32_weights(quantized_lm, caplog):
    """The check reads each weight's first and last outputs only (the float32 pages of a
    file-loaded model stay unread); a layer trained or edited since differs there."""
    import copy
    import logging

    from rag_spec.target.gguf import _checked, read_weights, source_file

    model = copy.deepcopy(quantized_lm.model)  # the fixture's is shared
    weights = read_weights(source_file(quantized_lm.model), model.config)
    assert _checked(weights, model).keys() == weights.keys()
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(1.01)  # as a step of training would
    with caplog.at_level(logging.INFO):
        kept = _checked(weights, model)
    assert kept.keys() == weights.keys() - {"model.layers.0.mlp.up_proj"}
    assert "model.layers.0.mlp.up_proj differs from the GGUF file" in caplog.text


def test_a_runner_holds_the_files_blocks_only_while_it_packs_them(quantized_lm):
    """The blocks are memory-mapped from rag-spec's cache: a reference kept after packing would
    hold every page packing read, beside the kernel's own copy (``rag-spec ask``'s peak RSS)."""
    import gc
    import weakref

    import rag_spec.target.gguf as gguf_module
    from rag_spec.target.transformers.runner import Runner, RunnerSettings

    kernel_or_skip()
    read = []
    reader = gguf_module.read_weights

    def watched(*args):
        weights = reader(*args)
        read.extend(weakref.ref(w.values) for w in weights.values())
        return weights

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_module, "read_weights", watched)
        runner = Runner(quantized_lm.model, RunnerSettings(quantized=True, compile=False))
    gc.collect()
    assert read and runner.stacks and all(stack.quantized for stack in runner.stacks)
    assert all(ref() is None for ref in read)
