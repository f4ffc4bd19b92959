"""Sampling keeps plain sampling's distribution (statistical tests with fixed seeds)."""

import pytest
import torch

from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.errors import RagSpecError
from rag_spec.target.sampling import SamplingParams, _top_p

N = 4000  # samples per test
PROMPT = [5, 9, 12, 5, 9, 12, 40, 5, 9]
KNOBS = {
    "temperature": {"temperature": 1.5},
    "top_k": {"temperature": 1.2, "top_k": 4},
    "top_p": {"temperature": 1.2, "top_p": 0.7},
}


def processed_probs(model, contexts: torch.Tensor, knobs: dict) -> torch.Tensor:
    """Plain sampling's next-token distribution, via transformers' own logits warpers."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    logits = model(contexts).logits[:, -1].float()
    logits = TemperatureLogitsWarper(knobs["temperature"])(contexts, logits)
    if "top_k" in knobs:
        logits = TopKLogitsWarper(knobs["top_k"])(contexts, logits)
    if "top_p" in knobs:
        logits = TopPLogitsWarper(knobs["top_p"])(contexts, logits)
    return logits.softmax(-1)


def exact_marginals(model, knobs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """P(first token) and P(second token), the latter summed over every first token."""
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        first = processed_probs(model, prompt, knobs)[0]
        vocab = first.shape[0]
        contexts = torch.cat([prompt.repeat(vocab, 1), torch.arange(vocab)[:, None]], dim=1)
        second = first @ processed_probs(model, contexts, knobs)
    return first, second


def chi_square_ok(samples: list[int], probs: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic (cells expecting < 5 samples pooled) and a 5-sigma bound for it."""
    counts = torch.bincount(torch.tensor(samples), minlength=probs.shape[0]).double()
    expected = probs.double() * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    return stat, dof + 5 * (2 * dof) ** 0.5


def assert_plain_sampling(model, results, knobs: dict) -> None:
    """The first two tokens of ``results`` are distributed as plain sampling's with ``knobs``,
    and the test can tell a wrong distribution apart (the same knobs at half the temperature)."""
    first, second = exact_marginals(model, knobs)
    for position, probs in ((0, first), (1, second)):
        stat, bound = chi_square_ok([r.token_ids[position] for r in results], probs)
        assert stat < bound, (position, stat, bound)
    colder, _ = exact_marginals(model, {**knobs, "temperature": knobs["temperature"] / 2})
    stat, bound = chi_square_ok([r.token_ids[0] for r in results], colder)
    assert stat > bound


@pytest.mark.parametrize("name", list(KNOBS))
def test_distribution_matches_plain_sampling(model, name):
    knobs = KNOBS[name]
    # full trees every step: a batch would time a plain first step, and these answers are short
    decoder = ablated(model, adaptive=False)
    greedy = decoder.generate(PROMPT, max_new_tokens=3).token_ids
    decoder.drafter.remember(PROMPT + greedy)  # draft the likeliest path: acceptance is exercised
    results = decoder.generate([PROMPT] * N, max_new_tokens=2, do_sample=True, seed=99, **knobs)
    assert sum(sum(r.stats.accepted_per_step) for r in results) > N // 10  # drafts were kept
    assert_plain_sampling(model, results, knobs)


@pytest.mark.parametrize("knobs", list(KNOBS.values()))
def test_a_seed_fixes_the_sample_whatever_the_drafts(model, knobs):
    # One uniform per output position: speculation changes the cost, never the tokens.
    plain = LookaheadDecoder(model, config=LookaheadConfig(budget=0))
    speculative = LookaheadDecoder(model)
    for seed in range(5):
        expected = plain.generate(PROMPT, 20, do_sample=True, seed=seed, **knobs)
        speculative.drafter.remember(PROMPT + expected.token_ids)  # drafts that often match
        got = speculative.generate(PROMPT, 20, do_sample=True, seed=seed, **knobs)
        assert got.token_ids == expected.token_ids
        assert expected.stats.steps == len(expected.token_ids)  # budget 0: no speculation
    assert got.stats.steps < len(got.token_ids)


@pytest.mark.parametrize("bad", [{"temperature": 0}, {"top_k": -1}, {"top_p": 0.0},
                                 {"top_p": 1.5}, {"repetition_penalty": 0}])
def test_invalid_knobs_are_refused_with_the_fix(bad):
    with pytest.raises(RagSpecError, match="must"):
        SamplingParams(do_sample=True, **bad)


def test_verification_processes_only_the_path_it_walks():
    # Top-p sorts the whole vocabulary per row: rows verification never reads are not computed.
    from rag_spec.engine.verify.acceptance import accept
    from rag_spec.target.sampling import target_choices
    from rag_spec.target.tree import TokenTree

    tree = TokenTree.from_paths([[1, 2, 3], [4, 5], [6]])
    logits = torch.full((1 + len(tree), 8), -5.0)
    logits[0, 1] = logits[1, 2] = logits[2, 7] = 5.0  # the target says 1, 2, then 7
    choices = target_choices(logits, [0], tree, SamplingParams(do_sample=True, top_p=0.9),
                             torch.full((4,), 0.5))
    assert accept(tree, choices) == ([0, 1], 7)
    assert sorted(choices.rows) == [0, 1, 2]  # the root, node 0, node 1: not the other 4


@pytest.mark.parametrize("scale", [0.05, 1.0, 4.0, 12.0])  # 0.05: flat, the nucleus past topk
@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.999])
def test_top_p_keeps_what_transformers_keeps(scale, top_p):
    from transformers.generation.logits_process import TopPLogitsWarper

    generator = torch.Generator().manual_seed(int(scale * 100 + top_p * 1000))
    logits = torch.randn(6, 5000, generator=generator) * scale
    kept = _top_p(logits, top_p).isfinite()
    expected = TopPLogitsWarper(top_p)(None, logits.clone()).isfinite()
    # a token whose probability-above sits within rounding of top_p may go either way
    probs = logits.double().softmax(-1)
    above = probs.sort(-1, descending=True).values.cumsum(-1) - probs.sort(
        -1, descending=True).values
    near = (above - top_p).abs().min(-1).values < 1e-5
    assert kept[~near].equal(expected[~near])
    assert (kept.sum(-1) >= 1).all()
