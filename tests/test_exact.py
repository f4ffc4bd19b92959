"""Exact numerics for half precision: in bfloat16 our greedy tokens equal transformers' bf16
``generate`` token for token, with drafts, trees and batches, because every token of a step is
computed bit for bit as ``generate``'s one-token step computes it."""

import pytest
import torch

from conftest import char_tokenizer, tiny_llama
from rag_spec.drafters.model_drafter import DraftModelDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.errors import RagSpecError
from rag_spec.target.transformers.runner import Runner, RunnerSettings
from rag_spec_kernels import RowChunkedLinear, invariant_rows
from test_decoder_greedy import hf_greedy, repetitive_prompt
from test_stopping_and_streaming import assert_stream_matches_generate

VOCAB = 512


def flat_bf16_llama(seed: int = 0, layers: int = 2):
    """A bf16 Llama whose logits are flat (a small init over a large vocabulary): top-2 ties
    and near ties are common, so the smallest rounding difference changes greedy tokens."""
    return tiny_llama(seed=seed, vocab_size=VOCAB, init=0.02, layers=layers,
                      hidden=256).to(torch.bfloat16)


def prompts(count: int) -> list[list[int]]:
    return [repetitive_prompt(s, vocab=VOCAB, length=24 + 9 * s) for s in range(count)]


@pytest.fixture(scope="module")
def model():
    return flat_bf16_llama()


@pytest.mark.parametrize("budget", [0, 4, 16])
def test_bf16_greedy_equals_bf16_generate(model, budget):
    decoder = ablated(model, config=LookaheadConfig(budget=budget), adaptive=False)
    assert decoder.runner.exact  # "auto": half precision
    for prompt in prompts(4):
        assert decoder.generate(prompt, 40).token_ids == hf_greedy(model, prompt, 40)


def test_bf16_batches_and_draft_models_equal_generate(model):
    draft = flat_bf16_llama(seed=0, layers=1)
    for drafter in (None, DraftModelDrafter(draft)):
        decoder = ablated(model, drafter=drafter, adaptive=False)
        batch = prompts(3)
        results = decoder.generate(batch, 30)
        assert [r.token_ids for r in results] == [hf_greedy(model, p, 30) for p in batch]


def test_exact_decoding_takes_its_first_token_from_the_prefill_and_streams(model):
    # the first token comes from the whole prompt's prefill, as generate's does; one token
    # is that token alone, and a stream shows it before the steps that follow
    decoder = LookaheadDecoder(model)
    prompt = prompts(1)[0]
    assert decoder.generate(prompt, 1).token_ids == hf_greedy(model, prompt, 1)
    tokenizer = char_tokenizer()
    chars = tiny_llama(seed=2, vocab_size=len(tokenizer), hidden=64).to(torch.bfloat16)
    ids = tokenizer("the cat sat on the mat. the cat")["input_ids"]
    assert_stream_matches_generate(LookaheadDecoder(chars, tokenizer), ids, 20)


def test_exact_numerics_need_sdpa_attention():
    eager = tiny_llama(hidden=64).to(torch.bfloat16)
    eager.set_attn_implementation("eager")
    assert not Runner.of(eager, RunnerSettings(exact="auto")).exact  # auto: not for eager
    with pytest.raises(RagSpecError, match="attn_implementation='sdpa'"):
        Runner.of(eager, RunnerSettings(exact=True))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_auto_turns_exact_numerics_on_for_half_precision_on_any_device(device):
    # on an H100 the fast kernels parted from bf16 generate on 0-1 of 4 prompts, exact on none
    from types import SimpleNamespace

    from rag_spec.target.transformers.runner import _wants_exact

    def model(dtype, attention="sdpa"):
        return SimpleNamespace(device=torch.device(device), dtype=dtype,
                               config=SimpleNamespace(_attn_implementation=attention))

    auto = RunnerSettings(exact="auto")
    assert _wants_exact(model(torch.bfloat16), auto)
    assert _wants_exact(model(torch.float16), auto)
    assert not _wants_exact(model(torch.float32), auto)
    assert not _wants_exact(model(torch.bfloat16, "flash_attention_2"), auto)


def test_without_exact_numerics_bf16_output_parts_from_generate(model):
    # What the exact path is for: the fast kernels round differently, and on this model that
    # changes tokens (if it ever stops doing so, the tests above no longer prove anything).
    decoder = ablated(model, config=LookaheadConfig(exact=False), adaptive=False)
    assert not decoder.runner.exact
    assert any(decoder.generate(p, 40).token_ids != hf_greedy(model, p, 40) for p in prompts(4))


def test_exact_numerics_leave_the_users_model_alone(model):
    implementation = model.config._attn_implementation
    linears = [type(m) for m in model.modules()]
    runner = Runner.of(model, RunnerSettings(exact=True))
    assert any(isinstance(m, RowChunkedLinear) for m in runner.module.modules())
    assert [type(m) for m in model.modules()] == linears
    assert model.config._attn_implementation == implementation


def test_chunked_rows_come_out_as_each_row_alone():
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 200).to(torch.bfloat16)
    counts = invariant_rows(linear)
    chunked = RowChunkedLinear(linear, counts)
    x = torch.randn(3, 23, 96).to(torch.bfloat16)  # 69 rows: chunks, the last padded
    with torch.inference_mode():
        alone = torch.stack([torch.stack([linear(row[None])[0] for row in seq]) for seq in x])
        assert torch.equal(chunked(x), alone)
        # no invariant count: row by row
        assert torch.equal(RowChunkedLinear(linear, ())(x), alone)


def test_a_kernel_that_sums_wide_rows_in_another_order_is_not_invariant(monkeypatch):
    # a stand-in kernel: one row summed in one pass, several rows in two halves of the inputs
    # (float32 sums, rounded to bfloat16), as a blocked half-precision kernel may
    stock = torch.nn.functional.linear

    def blocked(x, weight, bias=None):
        if x.reshape(-1, x.shape[-1]).shape[0] == 1:
            return stock(x.float(), weight.float()).to(x.dtype)
        half = x.shape[-1] // 2
        return (stock(x[..., :half].float(), weight[:, :half].float())
                + stock(x[..., half:].float(), weight[:, half:].float())).to(x.dtype)

    linear = torch.nn.Linear(1536, 64, bias=False).to(torch.bfloat16)
    monkeypatch.setattr(torch.nn.functional, "linear", blocked)
    torch.manual_seed(0)
    x = torch.randn(32, 1536).to(torch.bfloat16)
    weight = linear.weight
    with torch.inference_mode():
        alone = torch.cat([blocked(row, weight) for row in x.split(1)])
        random_rows_pass = [n for n in range(2, 33) if torch.equal(blocked(x[:n], weight),
                                                                    alone[:n])]
        assert random_rows_pass  # what a probe on random rows would have trusted
        assert invariant_rows(linear) == ()
