"""Greedy speculative decoding returns exactly transformers' greedy tokens."""

import pytest
import torch

from conftest import tiny_llama
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.policy.step_costs import StepCosts


def repetitive_prompt(seed: int, vocab: int = 64, length: int = 40) -> list[int]:
    """A prompt that repeats a phrase, so the trie has real drafts to offer."""
    g = torch.Generator().manual_seed(seed)
    phrase = torch.randint(3, vocab, (9,), generator=g).tolist()
    noise = torch.randint(3, vocab, (length,), generator=g).tolist()
    return (phrase + noise[:5] + phrase + noise[5:9] + phrase)[:length]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                         do_sample=False)
    new = out[0, len(prompt):].tolist()
    eos = model.generation_config.eos_token_id
    if eos is not None and eos in new:  # generate pads after EOS; the sequence ends at EOS
        new = new[:new.index(eos) + 1]
    return new


@pytest.mark.parametrize("budget", [1, 4, 16, 48])
@pytest.mark.parametrize("branch_length", [1, 3, 8])
@pytest.mark.parametrize("mode", ["tree", "chains"])
def test_matches_generate_for_every_budget_branch_and_mode(model, budget, branch_length, mode):
    config = LookaheadConfig(budget=budget, branch_length=branch_length)
    decoder = LookaheadDecoder(model, config=config,
                               drafter=TrieDrafter(branch_length=branch_length, mode=mode))
    for seed in range(3):
        prompt = repetitive_prompt(seed)
        result = decoder.generate(prompt, max_new_tokens=30)
        assert result.token_ids == hf_greedy(model, prompt, 30)


def remembered_answer(model) -> tuple[LookaheadDecoder, list[int], list[int]]:
    """A decoder whose drafter remembers the exact greedy answer to its prompt."""
    prompt = repetitive_prompt(7)
    first = hf_greedy(model, prompt, 40)
    decoder = LookaheadDecoder(model)
    decoder.drafter.remember(prompt + first)
    return decoder, prompt, first


def test_drafts_are_actually_accepted(model, flat_step_costs):
    # Once the drafter remembers this exact answer, most of it must come from drafts.
    decoder, prompt, first = remembered_answer(model)
    result = decoder.generate(prompt, max_new_tokens=40)
    assert result.token_ids == first
    assert result.stats.steps <= 10
    assert max(result.stats.accepted_per_step) >= 4


def test_drafts_that_cost_more_than_they_keep_are_not_verified(model, monkeypatch):
    # Each draft node costs a plain step: even the remembered answer's 8-token copies do not
    # pay, so once the first steps' trees are learnt from, every step is plain, with the same
    # output.
    monkeypatch.setattr(StepCosts, "verify", lambda self, width: float(width))
    decoder, prompt, first = remembered_answer(model)
    result = decoder.generate(prompt, max_new_tokens=40)
    assert result.token_ids == first
    # the first steps draft, while the proposals' cost is warming up (a first timing is not
    # counted), and keep up to two 8-token copies
    assert result.stats.drafted <= 3 * 12
    assert result.stats.steps >= 40 - 2 * 8
    assert result.stats.accepted_per_step[8:] == [0] * (result.stats.steps - 8)


def test_non_adaptive_and_adaptive_agree(model):
    prompt = repetitive_prompt(3)
    fixed = ablated(model, adaptive=False).generate(prompt, 30)
    adaptive = ablated(model, adaptive=True).generate(prompt, 30)
    assert fixed.token_ids == adaptive.token_ids == hf_greedy(model, prompt, 30)


@pytest.mark.parametrize("batch", [2, 3])
def test_batch_equals_each_prompt_alone(model, batch):
    prompts = [repetitive_prompt(s, length=20 + 7 * s) for s in range(batch)]
    decoder = LookaheadDecoder(model)
    results = decoder.generate(prompts, max_new_tokens=25)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 25) for p in prompts]


@pytest.mark.parametrize("cpu_attention", [True, False])
def test_steps_on_our_cpu_attention_or_sdpa_match_generate(cpu_attention, monkeypatch):
    import rag_spec_kernels.cpu_attention as kernel

    calls = []
    own = kernel.cpu_tree_attention
    monkeypatch.setattr(kernel, "cpu_tree_attention",
                        lambda *args, **kwargs: calls.append(1) or own(*args, **kwargs))
    model = tiny_llama(seed=8, hidden=64)  # heads of 16: the kernel takes them
    prompts = [repetitive_prompt(s, length=15 + 9 * s) for s in range(3)]  # ragged: holes
    decoder = ablated(model, cpu_attention=cpu_attention)
    results = decoder.generate(prompts, max_new_tokens=25)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 25) for p in prompts]
    assert bool(calls) == (cpu_attention and kernel.cpu_attention_available())


def test_padded_tensor_batch(model):
    prompts = [repetitive_prompt(1, length=12), repetitive_prompt(2, length=20)]
    ids = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, 20 - len(p):] = torch.tensor(p)
        mask[b, 20 - len(p):] = 1
    results = LookaheadDecoder(model).generate(ids, max_new_tokens=15, attention_mask=mask)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, 15) for p in prompts]


def test_single_token_prompt(model):
    assert LookaheadDecoder(model).generate([5], 10).token_ids == hf_greedy(model, [5], 10)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_eos_inside_a_draft_ends_exactly_there(seed, flat_step_costs):
    prompt = repetitive_prompt(seed)
    free_run = hf_greedy(tiny_llama(seed=1), prompt, 40)
    eos = free_run[12]  # a token the model really emits: make it the EOS
    model = tiny_llama(seed=1, eos=eos)
    expected = hf_greedy(model, prompt, 40)
    assert expected[-1] == eos
    decoder = LookaheadDecoder(model)
    decoder.drafter.remember(prompt + free_run)  # drafts now run on through the EOS
    result = decoder.generate(prompt, 40)
    assert result.token_ids == expected
    assert result.finish_reason == "eos"
    assert max(result.stats.accepted_per_step) >= 2


def test_repetition_penalty_matches_generate(model):
    prompt = repetitive_prompt(4)
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=25, do_sample=False,
                              repetition_penalty=1.3)[0, len(prompt):].tolist()
    result = LookaheadDecoder(model).generate(prompt, 25, repetition_penalty=1.3)
    assert result.token_ids == expected


def test_an_ablation_is_a_decoder_of_its_own_and_never_a_users_setting(model):
    """The benches switch parts off by building a decoder (``ablated``), never by changing one
    in place, and sizing is no field of the user's config."""
    decoder = LookaheadDecoder(model)
    off = ablated(model, cpu_attention=False, adaptive=False)
    assert off is not decoder and isinstance(off, LookaheadDecoder)
    assert decoder.runner.settings.cpu_attention and decoder._adaptive
    assert not off.runner.settings.cpu_attention and not off._adaptive
    assert not hasattr(LookaheadConfig(), "adaptive")
    with pytest.raises(TypeError, match="RunnerSettings fields"):
        ablated(model, cpu_atention=False)
    prompt = repetitive_prompt(4)
    assert off.generate(prompt, 20).token_ids == decoder.generate(prompt, 20).token_ids
