"""Self-speculation through a sparse view of the target's own KV cache (MagicDec): the view
selects sinks and a recent window, greedy output equals generate's for ragged batches, sampling
keeps plain sampling's distribution, the draft's entries never stay in the cache, and the draft
length follows MagicDec's cost model."""

import pytest
import torch
from test_tree_cache import tiny_mistral

from conftest import tiny_llama
from rag_spec.drafters.self_drafter import SelfSpecDrafter
from rag_spec.engine.decoder import LookaheadDecoder
from rag_spec.errors import RagSpecError
from rag_spec.policy.step_costs import Acceptance, StepCosts, expected_tokens
from rag_spec.target.transformers.kv_cache import new_cache
from rag_spec.target.transformers.prefill import prefill
from rag_spec.target.transformers.sink_window import SinkWindow
from rag_spec.target.transformers.step_inputs import round_step
from rag_spec.target.transformers.tree_cache import TreeKVCache
from test_decoder_greedy import hf_greedy, repetitive_prompt
from test_sampling import KNOBS, PROMPT, assert_plain_sampling


@pytest.fixture(scope="module")
def target():
    return tiny_llama(seed=3, layers=3, hidden=64)  # heads of 16: our CPU kernel takes them


def test_the_window_holds_each_rows_first_sinks_and_last_committed_slots():
    valid = torch.tensor([[False, False, True, True, True, True, True, True, True, True],
                          [True, True, False, True, True, False, True, True, False, True],
                          [False, False, False, False, False, False, False, False, True, True]])
    cache = TreeKVCache(new_cache(), valid, [0, 0, 0], None)
    window = SinkWindow(cache, sinks=2, window=3)

    def held():
        view = window.view
        return [sorted(s[p].tolist()) for s, p in zip(view.select, view.present)]

    assert held() == [[2, 3, 7, 8, 9], [0, 1, 6, 7, 9], [8, 9]]  # a short row: what it has
    before = window.view.select.clone()
    # a step commits 2, 0 and 3 tokens (compacted to the front of its 3 slots)
    cache.valid = torch.cat([valid, torch.tensor([[True, True, False], [False] * 3,
                                                  [True, True, True]])], dim=1)
    window.advance(cache)
    assert held() == [[2, 3, 9, 10, 11], [0, 1, 6, 7, 9], [8, 9, 10, 11, 12]]
    changed = (window.view.select != before).sum(dim=1).tolist()
    assert changed == [2, 0, 3]  # a ring: only the new tokens' entries moved


def test_a_view_of_every_slot_gives_the_targets_logits_pass_after_pass(target):
    from rag_spec.target.transformers.runner import Runner

    runner = Runner.of(target)
    prompts = [repetitive_prompt(s, length=12 + 5 * s) for s in range(3)]
    logits = {}
    for name in ("full", "view"):
        cache = prefill(runner, prompts)
        sparse = SinkWindow(cache, 2, cache.length).view if name == "view" else None
        passes = []
        for width in (1, 2):  # two passes of one round: the second sees the first's slots
            first = cache.round_length
            ids = torch.randint(3, 60, (3, width), generator=torch.Generator().manual_seed(width))
            positions = torch.tensor(cache.positions)[:, None] + first + torch.arange(width)
            sees = torch.ones(3, width, first + width, dtype=torch.bool).tril(first)
            passes.append(runner.forward(cache, round_step(cache, ids, positions, sees,
                                                           runner.dtype, sparse)))
        logits[name] = passes
    for full, view in zip(logits["full"], logits["view"]):
        torch.testing.assert_close(view, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("budget", [6, 12, 1000])
def test_greedy_matches_generate_for_a_ragged_batch(target, budget):
    prompts = [repetitive_prompt(s, length=14 + 11 * s) for s in range(4)]
    drafter = SelfSpecDrafter(budget=budget, sinks=2, max_gamma=4, probe_every=1)
    results = LookaheadDecoder(target, drafter=drafter).generate(prompts, 30)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 30) for p in prompts]


def test_a_full_view_drafts_what_the_target_says_and_leaves_no_entries(target):
    # A view as large as the context is the target itself: its drafts are all accepted.
    prompt = repetitive_prompt(1, length=30)
    drafter = SelfSpecDrafter(budget=1000, max_gamma=3, probe_every=1)
    ended, end = [], drafter.end
    drafter.end = lambda target: ended.extend(drafter._batches.values()) or end(target)
    result = LookaheadDecoder(target, drafter=drafter).generate(prompt, 40)
    assert result.token_ids == hf_greedy(target, prompt, 40)
    assert result.stats.tokens_per_step > 1.9
    assert not drafter._batches  # the batch's state went with its end
    (batch,) = ended
    assert batch.cache.round_length == 0  # the draft's entries were dropped after every round
    assert batch.cache.length == batch.cache.valid.shape[1] == len(
        batch.cache.cache.layers[0].keys[0, 0])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["temperature", "top_k"])
def test_sampling_keeps_the_distribution(model, name):
    knobs = KNOBS[name]
    # a view of 4 of the prompt's 8 cached tokens: the draft's q differs from the target's p
    drafter = SelfSpecDrafter(budget=4, sinks=1, max_gamma=2, probe_every=1)
    results = LookaheadDecoder(model, drafter=drafter).generate(
        [PROMPT] * 4000, max_new_tokens=2, do_sample=True, seed=99, **knobs)
    assert sum(sum(r.stats.accepted_per_step) for r in results) > 400  # drafts were kept
    assert_plain_sampling(model, results, knobs)


def test_a_sliding_window_model_is_refused_with_the_fix():
    decoder = LookaheadDecoder(tiny_mistral(6), drafter=SelfSpecDrafter(budget=8))
    with pytest.raises(RagSpecError, match="sliding window"):
        decoder.generate(repetitive_prompt(0), 5)


def test_bad_settings_are_refused():
    with pytest.raises(RagSpecError, match="sinks < budget"):
        SelfSpecDrafter(budget=4, sinks=4)
    with pytest.raises(RagSpecError, match="max_gamma"):
        SelfSpecDrafter(max_gamma=0)


def test_gamma_maximises_the_expected_rate_of_the_cost_model():
    costs = StepCosts(target={1: 1.0, 5: 1.2}, draft=0.1)
    # rate(g) = sum_b expected_tokens(g, alpha_b) / (g * draft + verify(g + 1))
    alphas = [0.8, 0.9]
    rates = {g: sum(expected_tokens(g, a) for a in alphas) / (g * 0.1 + costs.verify(g + 1))
             for g in range(7)}
    assert costs.best_gamma(alphas, 6) == max(rates, key=rates.get)
    assert costs.verify(3) == pytest.approx(1.1)  # interpolated between measured widths
    assert costs.best_gamma([0.2, 0.1], 6) == 0  # drafts that miss: plain decoding
    assert StepCosts(target={1: 1.0, 5: 1.2}, draft=0.9).best_gamma(alphas, 6) == 0  # too dear
    assert StepCosts(target={1: 1.0}, draft=0.01).best_gamma([0.95], 6) == 6  # cheap and right
    assert StepCosts(target={1: 1.0}).best_gamma([0.9], 6) is None  # the draft is unmeasured


def test_a_batch_drafts_one_token_until_its_passes_are_timed_then_times_a_plain_step():
    # where drafts lose (a 1k context: a sparse draft pass costs about a plain step) a first
    # chain of 3 lost ~3% of a batch's decoding; one draft pass times both passes as well
    from rag_spec.policy.budget import Prober, self_draft_gamma

    def gamma(costs: StepCosts) -> int:
        return self_draft_gamma(costs, [Acceptance().alpha], SelfSpecDrafter().max_gamma,
                                Prober(8, 8))

    assert gamma(StepCosts()) == 1  # nothing timed
    assert gamma(StepCosts(target={2: 1.2})) == 1  # the draft pass not yet
    assert gamma(StepCosts(target={2: 1.2}, draft=0.3)) == 0  # a plain step: what drafts beat


def test_gamma_grows_with_the_share_of_the_step_the_draft_saves():
    # MagicDec's shape: the longer the context (the dearer verification against a draft of
    # fixed cost), the longer the best draft.
    gammas = [StepCosts(target={1: t, 8: t * 1.1}, draft=0.05).best_gamma([0.8] * 16, 7)
              for t in (0.1, 0.3, 1.0, 3.0)]
    assert gammas == sorted(gammas) and gammas[0] < gammas[-1]


def test_acceptance_counts_trials_until_the_first_miss():
    acceptance = Acceptance(successes=0, failures=0)
    acceptance.record(drafted=4, accepted=4)  # four successes, no miss
    acceptance.record(drafted=4, accepted=1)  # one success, then a miss
    assert acceptance.alpha == pytest.approx((0.7 * 4 + 1) / (0.7 * 4 + 1 + 1))
