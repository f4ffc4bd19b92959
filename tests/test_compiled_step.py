"""Compiled verification steps (``LookaheadConfig(compile=True)``): a static KV cache and
torch.compile, with generate's greedy tokens for every drafter kind, batches of one prompt
length (static) and of several (the growing cache), and the user's model left alone."""

import pytest
import torch

from conftest import tiny_llama
from rag_spec.decoding import LookaheadConfig, LookaheadDecoder, SelfSpecDrafter
from rag_spec.decoding.model_drafter import DraftModelDrafter, EarlyExitDrafter
from rag_spec.errors import RagSpecError
from test_decoder_greedy import hf_greedy, repetitive_prompt

COMPILED = LookaheadConfig(compile=True)


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=0, layers=4)


DRAFTERS = {
    "trie": lambda: None,
    "draft model": lambda: DraftModelDrafter(tiny_llama(seed=0, layers=2)),
    # drafts in a round of its own on the target's (static) cache, then discards it
    "early exit": lambda: EarlyExitDrafter(2),
    # sparse passes on the target's cache: a sink-and-window view through the dense mask
    "self-speculation": lambda: SelfSpecDrafter(budget=8, sinks=2),
}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_compiled_steps_give_generates_greedy_tokens(target, name):
    decoder = LookaheadDecoder(target, config=COMPILED, drafter=DRAFTERS[name]())
    steps = []
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, 30)
        assert result.token_ids == hf_greedy(target, prompt, 30)
        steps.append(result.stats.steps)
    assert decoder.runner.compiled is not None
    if name == "trie":  # the repeats were drafted and kept: steps were trees, not one token
        assert min(steps) < 30


def test_a_static_batch_and_a_ragged_one_give_each_row_its_tokens(target):
    decoder = LookaheadDecoder(target, config=COMPILED)
    same = [repetitive_prompt(s, length=24) for s in range(3)]  # one length: a static cache
    ragged = [repetitive_prompt(s, length=10 + 7 * s) for s in range(3)]  # a growing one
    for prompts in (same, ragged):
        results = decoder.generate(prompts, 20)
        assert [r.token_ids for r in results] == [hf_greedy(target, p, 20) for p in prompts]


def test_compiling_leaves_the_users_model_alone():
    model = tiny_llama(seed=3)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    config = model.config.to_dict()
    LookaheadDecoder(model, config=COMPILED).generate(repetitive_prompt(0), 10)
    assert all((model.state_dict()[k] == v).all() for k, v in state.items())
    assert model.config.to_dict() == config
    assert not any("forward" in vars(m) or "_compiled_call_impl" in vars(m) and
                   m._compiled_call_impl is not None for m in model.modules())


def test_exact_numerics_cannot_be_compiled():
    with pytest.raises(RagSpecError, match="exact=False"):
        LookaheadDecoder(tiny_llama(), config=LookaheadConfig(compile=True, exact=True))
    # "auto" asks for exact numerics in bfloat16; with compile it gives way
    model = tiny_llama().to(torch.bfloat16)
    assert not LookaheadDecoder(model, config=COMPILED).runner.exact
