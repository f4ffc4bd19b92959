"""The adaptive budget: drafts stop while they miss, probes back off, a hit restores them; and
the batch's tree size, from what each size keeps against what its step costs."""

import math

import pytest

from rag_spec.policy.budget import (
    PROBE_SHARE,
    STEADY_TREES,
    AdaptiveBudget,
    TreeSizer,
)
from rag_spec.policy.step_costs import StepCosts


def drafting_steps(budget: AdaptiveBudget, steps: int, hits=lambda step: 0, cost: float = 0.0
                   ) -> list[int]:
    """The steps at which ``budget`` lets a draft through, with ``hits(step)`` accepted from
    trees drafted at ``cost`` target steps."""
    drafted = []
    for step in range(steps):
        nodes = budget.current
        if nodes:
            drafted.append(step)
        budget.update(nodes, hits(step) if nodes else 0, cost)
    return drafted


def test_probes_back_off_while_drafts_keep_missing():
    # Optimistic first steps, then probes at growing intervals: 4, 8, 16, ... up to 64.
    assert drafting_steps(AdaptiveBudget(8), 200) == [0, 1, 2, 3, 4, 8, 16, 32, 64, 128, 192]


def test_a_steady_drafters_probes_keep_their_pace_and_a_few_misses_do_not_stop_it():
    # A trained draft's misses come one at a time: a useless one stops at its first miss (its
    # estimate is a running mean at first), and its probes do not back off ...
    assert drafting_steps(AdaptiveBudget(8, steady=True), 40) == [0, *range(4, 40, 4)]
    # ... and after drafts kept half a token a step, four misses in a row (one run in sixteen
    # at that rate) do not stop them; a trie's, whose misses come in runs, they do.
    steady, trie = AdaptiveBudget(8, steady=True), AdaptiveBudget(8)
    for budget in (steady, trie):
        for step in range(40):
            budget.update(8, step % 2)
        for _ in range(4):
            budget.update(8, 0)
    assert steady.paying and not trie.paying


def test_a_resumed_budget_starts_from_the_estimates_and_keeps_them_against_a_few_misses():
    learnt = AdaptiveBudget(8, steady=True)
    for step in range(60):
        learnt.record(4, [0] if step % 2 else [], cost=0.05)
    resumed = learnt.resumed()
    assert resumed.trees == STEADY_TREES and resumed.steady and resumed.full == 8
    assert (resumed.mean_accepted, resumed.kept, resumed.cost) == (
        learnt.mean_accepted, learnt.kept, learnt.cost)
    fresh = AdaptiveBudget(8, steady=True)
    for budget in (resumed, fresh):  # an answer that starts with three misses
        for _ in range(3):
            budget.record(4, [], cost=0.05)
    assert resumed.paying and not fresh.paying  # from scratch, they stopped its drafting
    resumed.record(4, [0])
    assert learnt.kept != resumed.kept and learnt.trees == 60  # the learnt ones stay as they were


def test_a_probe_that_hits_brings_drafting_back():
    drafted = drafting_steps(AdaptiveBudget(8), 80, hits=lambda step: 3 if step == 32 else 0)
    assert 32 in drafted and 33 in drafted  # the hit restored the full budget at once


def test_a_fixed_budget_always_drafts():
    assert len(drafting_steps(AdaptiveBudget(8, adaptive=False), 50)) == 50


def test_drafts_that_cost_more_than_they_keep_stop_and_probe_within_their_share():
    # Trees keep a token: enough when drafting is a lookup, not when it costs a step.
    cheap, dear = AdaptiveBudget(8), AdaptiveBudget(8)
    cheap.update(8, 1, cost=0.0)
    dear.update(8, 1, cost=1.0)  # the first cost is taken as measured, not smoothed from 0
    assert cheap.paying and not dear.paying and dear.cost == 1.0
    # Probes then come no more often than keeps them within PROBE_SHARE of the steps' time.
    interval = math.ceil(1.0 / PROBE_SHARE)
    drafted = drafting_steps(dear, 3 * interval - 10, cost=1.0)
    assert drafted == [interval - 1, 2 * interval - 1]


def test_a_step_teaches_what_every_other_tree_size_would_have_kept():
    budget = AdaptiveBudget(8, smoothing=0.0)  # no smoothing: the curve is the last step's
    # A 5-node tree kept nodes 0 then 3: its first n nodes keep node 0 from n = 1 and node 3
    # from n = 4; a larger tree is taken to keep as much.
    budget.record(5, [0, 3])
    assert budget.kept == [0.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    assert budget.mean_accepted == 2.0
    budget.record(5, [])
    assert budget.kept == [0.0] * 9


def test_the_first_measurement_replaces_the_optimistic_start():
    budget = AdaptiveBudget(4)
    assert budget.kept == [0.0, 1.0, 2.0, 2.0, 2.0]  # the first steps draft full trees
    budget.record(4, [1])
    assert budget.kept == [0.0, 0.0, 1.0, 1.0, 1.0]
    budget.record(4, [0, 1, 2])  # then a running mean of the first few
    assert budget.kept == [0.0, 0.5, 1.5, 2.0, 2.0]


def test_a_larger_tree_is_expected_to_keep_at_least_what_a_smaller_one_keeps():
    budget = AdaptiveBudget(4)
    budget.kept = [0.0, 1.5, 0.5, 2.0, 0.1]  # sizes measured at different times
    assert [budget.expected(n) for n in range(6)] == [0.0, 1.5, 1.5, 2.0, 2.0, 2.0]


def rows(*kept: float, reach: int = 12, full: int = 12) -> list[AdaptiveBudget]:
    """Budgets whose rows keep ``k`` draft tokens from trees of ``reach`` nodes or more."""
    budgets = [AdaptiveBudget(full) for _ in kept]
    for budget, k in zip(budgets, kept):
        budget.kept = [0.0] * reach + [k] * (full + 1 - reach)
    return budgets


def best(budgets: list[AdaptiveBudget], costs: StepCosts, remaining: list[int] | None = None
         ) -> int:
    costs.rows = len(budgets)
    return TreeSizer(12).best(budgets, remaining or [64] * len(budgets), costs)


def test_tree_size_maximises_committed_tokens_per_second():
    cheap = StepCosts(target={1: 1.0, 13: 1.1})  # two rows alike: a batch is sized
    assert best(rows(0.5, 0.5, reach=1), cheap) == 1  # as good as larger, cheaper
    assert best(rows(0.5, 0.5, reach=5), cheap) == 5
    assert best(rows(0.5, 0.5), cheap) == 12  # 1.5 tokens for 1.1 steps
    dear = StepCosts(target={1: 1.0, 13: 3.0})
    assert best(rows(0.5, 0.5), dear) == 0  # a plain step commits faster
    assert best(rows(2.5, 2.5, reach=2), dear) == 2  # 3.5 tokens for 1.33 steps


def test_a_single_row_verifies_the_size_that_pays_best():
    # one row on a short prompt: a 13-token step costs it little more than a plain one
    cut = rows(0.5, reach=5)
    assert best(cut, StepCosts(target={1: 1.0, 13: 1.1})) == 5  # 1.5 tokens for ~1.03 steps
    assert best(rows(0.5), StepCosts(target={1: 1.0, 13: 1.1})) == 12  # larger keeps more
    assert best(cut, StepCosts(target={1: 1.0, 13: 1.6})) == 5  # whole trees lose to plain
    assert best(rows(0.2, reach=5), StepCosts(target={1: 1.0, 13: 1.6})) == 0  # nor cuts
    cut[0].cost = 0.5  # a draft model's passes: weighed against what trees keep
    assert best(cut, StepCosts(target={1: 1.0, 13: 1.1})) == 0
    # a steady drafter's single row (the draft head's) is sized as any other: a whole tree
    # that does not pay is cut to the size that does, not dropped for plain steps
    steady, head = TreeSizer(12, steady=True), rows(0.5, reach=5)
    assert steady.best(head, [64], StepCosts(target={1: 1.0, 13: 1.6})) == 5
    assert steady.best(rows(0.2, reach=5), [64], StepCosts(target={1: 1.0, 13: 3.0})) == 0


def test_a_batch_drafts_for_the_row_it_waits_for():
    costs = StepCosts(target={1: 1.0, 13: 1.5})
    assert best(rows(3.0), costs) == 12  # alone: 4 tokens for 1.5 steps
    assert best(rows(3.0, *[0.0] * 15), costs) == 0  # the batch ends with its slowest row
    assert best(rows(3.0, 0.0), costs, [64, 16]) == 12  # the other row is done 4x sooner
    assert best(rows(3.0, 0.0), costs, [64, 64]) == 0


def test_a_batch_that_copies_everywhere_drafts():
    assert best(rows(*[3.0] * 16), StepCosts(target={1: 1.0, 13: 3.0})) == 12  # 4 for 3


def test_while_no_size_pays_rows_propose_at_growing_intervals_without_verifying():
    costs = StepCosts(target={1: 1.0, 13: 3.0}, rows=2)
    sizer = TreeSizer(12)
    sizes = [sizer.size(rows(0.0, 0.0), [64, 64], costs) for _ in range(40)]
    assert {cap for cap, _ in sizes} == {0}
    assert [step for step, (_, propose) in enumerate(sizes) if propose] == [3, 11, 27]
    assert TreeSizer(12).size(rows(0.0), [64], StepCosts()) == (12, True)  # nothing measured
    assert TreeSizer(12, adaptive=False).size(rows(0.0, 0.0), [64, 64], costs
                                              ) == (12, True)  # fixed
    steady = TreeSizer(12, steady=True)  # a trained draft's probes keep their pace
    sizes = [steady.size(rows(0.0, 0.0), [64, 64], costs) for _ in range(20)]
    assert [step for step, (_, propose) in enumerate(sizes) if propose] == [3, 7, 11, 15, 19]
    assert TreeSizer(12).size(rows(0.5, 0.5, reach=5), [64, 64],
                              StepCosts(target={1: 1.0, 13: 1.1}, rows=2)) == (5, True)


def test_a_dear_draft_must_pay_for_itself_and_probes_stay_within_their_share():
    # 1.5 tokens for a 1.1-step verification pays, unless drafting costs a step more.
    costs = StepCosts(target={1: 1.0, 13: 1.1})
    assert best(rows(0.5), costs) == 12
    dear = rows(0.5, 0.5)
    dear[1].cost = 1.0  # one row's trees cost a plain step: the batch's passes do
    assert best(dear, costs) == 0
    sizer = TreeSizer(12)
    sizes = [sizer.size(dear, [64, 64], costs) for _ in range(120)]
    interval = math.ceil(1.0 / PROBE_SHARE)  # probes cost a step: one in 50 plain steps
    assert [step for step, (_, propose) in enumerate(sizes) if propose] == [
        interval - 1, 2 * interval - 1]


def test_drafting_is_weighed_at_what_proposals_took_not_only_at_their_count():
    costs = StepCosts(target={1: 1.0, 13: 1.1})
    budgets = rows(0.5)
    budgets[0].cost = 0.3  # counted by the weights its passes read
    assert costs.drafting(0.3) == 0.3  # nothing timed yet: the count
    assert best(budgets, costs) == 12  # 1.5 tokens for 1.1 + 0.3 steps pays
    costs.record_proposal(0.3, 5.0)  # a warm-up: not counted
    assert costs.drafting(0.3) == 0.3
    costs.record_proposal(0.3, 0.9)  # per-pass overheads: three times what the count says
    assert costs.drafting(0.3) == pytest.approx(0.9)
    assert best(budgets, costs) == 0  # 1.5 tokens for 2.0 steps does not


def test_a_merged_models_passes_are_weighed_by_the_sizer_while_its_budget_drafts():
    """A plain step spares a merged drafter's model its passes: the sizer weighs them beside
    the trees' own drafting (a draft head on a GGUF file's target, whose extra rows are dear,
    made trees that paid on float32 lose to plain steps)."""
    from rag_spec.policy.plan import RowPolicy

    costs = StepCosts(target={1: 1.0, 13: 1.6})
    cut = rows(0.5, reach=5)
    assert best(cut, costs) == 5  # 1.5 tokens for ~1.2 steps
    assert TreeSizer(12).best(cut, [64], costs, models=0.4) == 0  # 1.5 for ~1.6: plain wins
    row = RowPolicy(cut[0], AdaptiveBudget(1, steady=True))
    row.source.cost = 0.4
    assert row.model_cost == 0.4  # its budget drafts: its recent guesses' cost
    row.source.mean_accepted, row.source.prober.idle = 0.0, 0  # missing, no probe due
    assert row.model_cost == 0.0
    assert RowPolicy(cut[0]).model_cost == 0.0  # no merged model


def test_a_batch_steps_plain_before_any_cost_is_measured():
    # one row drafts its full trees from the start (a wide step costs it little more than a
    # plain one); a batch times a plain step first: at 16 x 4k a 13-token step costs several
    assert TreeSizer(12).size(rows(0.0), [64], StepCosts()) == (12, True)
    assert TreeSizer(12).size(rows(0.0, 0.0), [64, 64], StepCosts(rows=2)) == (0, False)


def test_unmeasured_widths_cost_more_per_token_for_more_rows():
    # each extra token per row is a row more per batch row through every layer
    alone, batch = StepCosts(target={1: 1.0}), StepCosts(target={1: 1.0}, rows=16)
    assert alone.verify(13) == pytest.approx(1.6)  # 0.05 of a plain step per token
    assert batch.verify(13) == pytest.approx(1 + 12 * 16 * 0.015)
    # so a full tree keeping 2 tokens pays for one row and not for sixteen
    assert best(rows(2.0), alone) == 12
    assert best(rows(*[2.0] * 16), batch) == 0


def test_two_noisy_neighbours_do_not_make_a_wider_pass_look_dear():
    # measured on a draft head's batch: widths 8 and 9 a noisy 2.75 ms apart, the rest flat
    costs = StepCosts(target={1: 10.66, 3: 12.42, 6: 12.44, 7: 13.87, 8: 11.94, 9: 14.69})
    assert costs.verify(13) == pytest.approx(14.69 * (1 + 0.05 * 4))  # the prior bounds it
    assert costs.verify(13) < 14.69 + 4 * (14.69 - 11.94)  # not the neighbours' slope
    steep = StepCosts(target={1: 1.0, 2: 2.0, 3: 3.0})  # a batch whose rows all pay per token
    assert steep.verify(5) == pytest.approx(5.0)


def test_an_unmeasured_narrower_pass_is_expected_a_little_cheaper():
    costs = StepCosts(target={13: 2.0})
    assert 0 < costs.verify(1) < costs.verify(5) < 2.0 < costs.verify(20)


def test_the_decoder_sizes_trees_where_tokens_do_not_depend_on_them(monkeypatch):
    import rag_spec.policy.plan as plan_module
    from conftest import tiny_llama
    from rag_spec.drafters.model_drafter import EarlyExitDrafter
    from rag_spec.drafters.self_drafter import SelfSpecDrafter
    from rag_spec.engine.decoder import LookaheadDecoder

    built = []

    class Spy(TreeSizer):
        def __init__(self, *args, **kwargs):
            built.append(True)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(plan_module, "TreeSizer", Spy)
    model, prompt = tiny_llama(), [5, 6, 7, 5, 6]
    LookaheadDecoder(model).generate(prompt, 4)
    assert built == [True]  # the trie, greedy: sized
    LookaheadDecoder(model).generate(prompt, 4, do_sample=True, seed=1)
    assert built == [True, True]  # sampled, but the trie's drafts are not drawn: sized
    LookaheadDecoder(model, drafter=EarlyExitDrafter(1)).generate(prompt, 4, do_sample=True,
                                                                  seed=1)
    assert built == [True, True]  # drawn drafts, sampled: each row keeps its own budget
    LookaheadDecoder(model, drafter=SelfSpecDrafter(budget=8)).generate(prompt, 4)
    assert built == [True, True]  # the self-drafter chooses its own draft lengths


def test_a_single_row_verifies_what_pays_of_its_trees(monkeypatch):
    """The trie's proposals cost nothing, but each node widens the step: one row verifies its
    copies where they keep, and fewer nodes where they miss, keeping every token whole trees
    keep."""
    from conftest import counting, tiny_llama
    from rag_spec.drafters.trie_drafter import TrieDrafter
    from rag_spec.engine.decoder import ablated
    from test_decoder_greedy import hf_greedy, repetitive_prompt

    # a short prompt's step costs: each token past the first a twentieth of a plain step
    monkeypatch.setattr(StepCosts, "verify", lambda self, width: 1 + 0.05 * (width - 1))
    model = tiny_llama()
    prompt = repetitive_prompt(7)
    answer = hf_greedy(model, prompt, 40)
    results = {}
    for adaptive in (True, False):
        drafter = counting(TrieDrafter)()
        drafter.remember(prompt + answer)  # 8-token copies of the answer
        results[adaptive] = ablated(model, drafter=drafter, adaptive=adaptive).generate(
                                    prompt, 40)
        assert results[adaptive].token_ids == answer
    sized, whole = results[True].stats, results[False].stats
    assert sum(sized.accepted_per_step) == sum(whole.accepted_per_step) > 0
    assert 0 < sized.drafted < whole.drafted


@pytest.mark.parametrize(("committed", "learnt"), [
    ([9], []),  # left the tree at its root: settled on the step that verified it
    ([5, 9], [0]),  # left it below a node
    ([5, 6, 7], [0, 1, 2]),  # reached a leaf
    ([5], None),  # inside the tree, a child may still follow: wait for the next tokens
])
def test_a_proposal_is_learnt_from_as_soon_as_the_committed_tokens_settle_its_path(
        committed, learnt):
    from rag_spec.policy.plan import RowPolicy
    from rag_spec.target.tree import TokenTree

    class Recording(AdaptiveBudget):
        paths: list[list[int]] = []

        def record(self, drafted, path, cost=0.0):
            self.paths.append(list(path))

    budget = Recording(8)
    row = RowPolicy(budget)
    row.proposed(TokenTree.from_paths([[5, 6, 7], [5, 8, 3]]), 2, 0.0)
    row.learn([1, 2, *committed], finished=False)
    assert budget.paths == ([] if learnt is None else [learnt])
    row.learn([1, 2, *committed], finished=True)  # a finished row learns what is left
    assert len(budget.paths) == 1


def test_a_cost_is_counted_from_its_second_timing_the_first_being_a_warm_up():
    # the first pass of a width (or a draft, or a proposal) pays for kernels being picked or
    # compiled (Triton compiles a kernel variant at its first launch)
    costs = StepCosts()
    costs.record_target(4, 1.0)
    costs.record_draft(2.0, 2)
    costs.record_proposal(2.0, 2.0)
    assert (costs.target, costs.draft, costs.counted_step) == ({}, None, None)
    costs.record_target(4, 0.1)
    costs.record_draft(0.2, 2)
    costs.record_proposal(2.0, 0.2)
    assert (costs.target[4], costs.draft, costs.counted_step) == (0.1, 0.1, 0.1)
    costs.record_target(4, 0.2)
    assert costs.target[4] == pytest.approx(0.7 * 0.1 + 0.3 * 0.2)  # smoothed from here on
    given = StepCosts(target={1: 1.0})  # given costs count as measured: blended into
    given.record_target(1, 0.0)
    assert given.target[1] == pytest.approx(0.7)


def test_one_prober_backs_off_after_misses_returns_to_its_pace_on_a_hit_and_bounds_its_cost():
    from rag_spec.policy.budget import PROBE_SHARE, Prober

    prober = Prober(every=2, longest=8)
    gaps = []
    for hits in (False, False, False, False, True, False):
        idle = 0
        while not prober.due():
            prober.wait()
            idle += 1
        gaps.append(idle + 1)  # steps from the last draft to this probe
        prober.drafted(hit=hits)
    assert gaps == [2, 4, 8, 8, 8, 2]  # doubled after each miss, capped, reset by the hit
    dear = Prober(every=2)
    steps = 1
    while not dear.due(cost=0.5):  # a probe costing half a plain step
        dear.wait()
        steps += 1
    assert 0.5 / steps <= PROBE_SHARE


def test_one_planner_sizes_chains_for_the_rows_that_draft_and_none_for_finished_rows():
    from rag_spec.policy.plan import Policy

    policy = Policy(12)
    planner = policy.planner(greedy=True, draws_drafts=True, constrained=False, steady=False,
                             chain=4, chain_probes=8)
    assert planner.sizer is None  # chains are verified whole
    rows = [policy.row(greedy=True, steady=False), None, policy.row(greedy=True, steady=False)]
    plans = planner.plan(rows, [10, 10], StepCosts())
    assert [p.nodes for p in plans] == [1, 0, 1]  # nothing timed: one draft pass times both
    assert all(p.verify == 12 for p in plans)
    timed = StepCosts(target={1: 1.0, 2: 1.02, 5: 1.1}, draft=0.01)
    for row in rows[::2]:
        row.model.record(4, 4)  # chains that hold
    assert {p.nodes for p in planner.plan(rows, [10, 10], timed, room=3)} == {4, 0}
    assert all(p.verify == 3 for p in planner.plan(rows, [10, 10], timed, room=3))
    segment = policy.segment_planner(chain=4)  # a RaLM segment's one row: chains sized alike
    assert segment.sizer is None
    assert segment.plan([policy.segment()], [10], StepCosts())[0].nodes == 1


def test_what_a_drafter_spends_is_what_the_rows_budget_weighs():
    from rag_spec.policy.plan import Policy
    from rag_spec.target.tree import TokenTree

    row = Policy(4).row(greedy=True, steady=False)
    plan = Policy(4).planner(greedy=True, draws_drafts=True, constrained=False,
                             steady=False).plan([row], [8], StepCosts())[0]
    plan.spend(0.5)
    plan.spend(0.25)
    row.proposed(TokenTree.from_paths([[7]]), 0, plan.spent)
    row.learn([9, 3], finished=False)  # missed at the root: settled at once
    assert row.budget.cost == pytest.approx(0.75)


@pytest.mark.parametrize("greedy", [True, False])
def test_a_merged_models_guesses_are_weighed_at_what_proposals_took_for_greedy_rows(greedy):
    # a head's passes on a GGUF file's target: three times dearer than their weights say
    from rag_spec.policy.plan import Policy, RowPlan
    from rag_spec.target.tree import TokenTree

    costs = StepCosts(target={1: 1.0})
    costs.record_proposal(0.3, 5.0)  # a warm-up: not counted
    costs.record_proposal(0.3, 0.9)
    row = Policy(4).row(greedy=greedy, steady=True)
    plan = RowPlan(4, 4, row)
    model = plan.model([1, 2], TokenTree.empty(), greedy=greedy, eager=True,
                       reads_features=True, steady=True, costs=costs)
    model.spend(0.3)
    plan.guessed([1, 2], TokenTree.from_paths([[7]]), model)
    assert plan.model_spent == pytest.approx(0.3)  # what the decoder times proposals by
    plan.model([1, 2, 9], TokenTree.empty(), greedy=greedy, eager=True, reads_features=True,
               steady=True, costs=costs)  # learns the guess missed, at its cost
    # a sampled row's drafts stay reproducible: its cost is the count, never a timing
    assert row.source.cost == pytest.approx(0.9 if greedy else 0.3)
