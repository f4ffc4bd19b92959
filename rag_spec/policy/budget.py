"""How many draft nodes to verify next step: per row, from how many were being accepted; per
batch, from what that acceptance earns against what a wider step costs."""

from __future__ import annotations

import copy
import math
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate

from rag_spec.policy.step_costs import StepCosts

PROBE_SHARE = 0.02  # the most of plain decoding's time that probes (drafts not verified) take

# A trie's drafts hit in runs (an answer copies a passage for a while, then stops): estimates
# follow the last few trees, and probes back off while copying has stopped. A trained draft's
# hit or miss about independently from step to step around a rate that changes slowly
# (measured: the draft head on the embedded model's open-ended answers, consecutive positions'
# hits all but uncorrelated, docs/concepts.md): estimates following the last few trees
# swing with every miss, fall below what drafts cost, and with probes backing off stay there
# (docs/concepts.md, "Why the defaults"). A steady drafter's estimates average over about
# twenty trees, and its probes keep their pace.
STEADY_SMOOTHING = 0.95
# A steady drafter's acceptance belongs to the drafter and the model more than to one request,
# so a new greedy row starts from the estimates the last ended with (``AdaptiveBudget.resumed``)
# counted as this many trees: the ~twenty the smoothing averages over. From scratch, a few
# misses among an answer's first trees stopped the head's drafting there for a while (fewer
# tokens per step from scratch than carried over, on open-ended prompts).
STEADY_TREES = 20


class Prober:
    """When drafts that stopped paying are tried again: the one back-off every sizing decision
    uses (a row's budget, a batch's tree size, a self-draft's gamma).

    A probe is due after ``every`` idle steps at first, twice as many after each probe that
    missed (up to ``longest``), ``every`` again once one hits; and never more often than keeps
    probes costing ``cost`` plain steps within ``PROBE_SHARE`` of the steps' time.
    """

    def __init__(self, every: int = 4, longest: int = 64) -> None:
        self.every = every
        self.longest = max(longest, every)
        self.interval = every  # idle steps between probes now
        self.idle = 0  # idle steps since the last draft

    def due(self, cost: float = 0.0) -> bool:
        """Whether the next step probes (a draft at ``cost`` plain steps)."""
        return self.idle >= max(self.interval, _affordable_interval(cost)) - 1

    def wait(self) -> None:
        """A step without drafts."""
        self.idle += 1

    def drafted(self, hit: bool, probe: bool = True) -> None:
        """A step drafted; ``hit``: the target kept some of it. A ``probe`` that missed backs
        off; a hit restores the first pace."""
        self.idle = 0
        if hit:
            self.interval = self.every
        elif probe:
            self.interval = min(2 * self.interval, self.longest)


def merged_share(budget: int, copies: int, *, ranked: bool = False) -> int:
    """Nodes a model's draft may take of a merged tree's ``budget`` beside the trie's
    ``copies``: what the trie left, and at least half (the trie proposes first, for free). A
    ``ranked`` tree (a greedy row's, cut to its likeliest nodes) whose draft costs no more for
    more nodes (a head on the target's states) offers it the whole budget: the ranking, not a
    split, then chooses between guesses and copies."""
    return budget if ranked else max(budget // 2, budget - copies)


# draft tokens kept per round, on a draft model's trial window, that earn it the whole context
TRIAL_PAYS = 0.5


def trial_pays(accepted: int, rounds: int) -> bool:
    """Whether a draft model on trial (reading only the last tokens of each context) has kept
    enough of its drafts over ``rounds`` rounds (``accepted`` in all) to read the contexts
    whole: a draft that keeps missing never costs the prefill of a long prompt."""
    return rounds > 1 and accepted >= TRIAL_PAYS * rounds


def self_draft_gamma(costs: StepCosts, alphas: Sequence[float], max_gamma: int,
                     prober: Prober) -> int:
    """How many tokens a self-draft chain runs this round for rows accepting with ``alphas``:
    the best expected rate by the measured costs (MagicDec's cost model), 0 where drafting
    loses to plain steps, except a one-token probe when ``prober`` says one is due."""
    best = costs.best_gamma(alphas, max_gamma)
    if best is None:  # nothing measured yet: one draft pass measures both passes at the
        return 1  # least risk
    if 1 not in costs.target:  # a plain step, measured: what every draft must beat
        return 0
    if best > 0:
        prober.drafted(hit=True)
        return best
    if prober.due():
        prober.drafted(hit=False)
        return 1  # a probe: acceptance and costs may have changed with the context
    prober.wait()
    return 0


def depth_pays(mean_accepted: float, depth: int, cost: float) -> bool:
    """Whether a draft pass for depth ``depth + 1`` pays, at ``cost`` target steps a pass:
    each depth is accepted with about ``alpha = m / (1 + m)`` when ``m`` draft tokens are kept
    per round on average (a geometric run), so the pass pays while the path to ``depth`` is
    likelier to be accepted than the pass costs."""
    alpha = mean_accepted / (1 + mean_accepted)
    return alpha ** depth >= cost


class AdaptiveBudget:
    """The full budget while drafts pay for themselves; none while they keep missing.

    A verified tree costs a little more than a one-token step, and a draft model's passes cost
    more still (a tree's ``cost``, in target steps). So when the recent mean of accepted tokens
    falls below ``threshold`` plus the recent drafts' cost, the next steps draft nothing (a
    plain step's cost), except probe steps that measure whether drafts pay again: one in
    ``probe_every`` at first, half as often after each probe that missed too (down to one in
    ``max_probe_every``), as often as at first again once one hits; and never more often than
    keeps probes within ``PROBE_SHARE`` of the steps' time. The costs are counted in target
    steps, not timed, so a sampled row drafts the same whatever runs beside it. A ``steady``
    drafter's (a trained draft's) estimates smooth more and its probes do not back off
    (``STEADY_SMOOTHING``).
    """

    def __init__(self, full: int, *, adaptive: bool = True, threshold: float = 0.2,
                 probe_every: int = 4, max_probe_every: int = 64, smoothing: float = 0.7,
                 initial: float = 1.0, steady: bool = False) -> None:
        self.full = full
        self.adaptive = adaptive
        self.threshold = threshold
        self.prober = Prober(probe_every, probe_every if steady else max_probe_every)
        self.smoothing = STEADY_SMOOTHING if steady else smoothing
        self.steady = steady
        self.mean_accepted = initial  # 1.0: an optimistic start, the first steps draft
        # kept[n]: smoothed draft tokens a step keeps with its tree cut to its first n nodes;
        # optimistic at first (``initial`` for one node, twice that for more), so the first
        # steps draft full trees and measure every size's acceptance
        self.kept = [initial * min(n, 2) for n in range(full + 1)]
        self._proposals = 0  # proposals recorded (each measures every size)
        self.cost = 0.0  # smoothed cost of a proposal, in target steps

    @property
    def paying(self) -> bool:
        """Whether drafts keep more than they cost lately."""
        return self.mean_accepted >= self.threshold + self.cost

    @property
    def current(self) -> int:
        if not self.adaptive or self.paying:
            return self.full
        return self.full if self.prober.due(self.cost) else 0

    @property
    def trees(self) -> int:
        """Proposals recorded so far: what the estimates rest on."""
        return self._proposals

    def resumed(self) -> AdaptiveBudget:
        """A new row's budget with this one's settings and estimates, as if it had seen up to
        ``STEADY_TREES`` trees, its probes at their first pace."""
        budget = self.carried()
        budget._proposals = min(self._proposals, STEADY_TREES)
        budget.prober = Prober(self.prober.every, self.prober.longest)
        return budget

    def carried(self) -> AdaptiveBudget:
        """A copy that goes on where this one stopped, its probes' pace included: a draft's
        cost and hits outlast one request, and so does the share of time its probes take."""
        budget = copy.copy(self)
        budget.kept = list(self.kept)
        budget.prober = copy.copy(self.prober)
        return budget

    def update(self, drafted: int, accepted: int, cost: float = 0.0) -> None:
        """Record a step that verified ``drafted`` nodes and kept ``accepted`` of them, drafted
        at ``cost`` target steps."""
        if drafted == 0:
            self.prober.wait()
            return
        self.prober.drafted(hit=accepted > 0, probe=not self.paying)
        self._proposals += 1
        # A trie's start stays optimistic for a few trees (a copy often starts a few tokens
        # in); a steady drafter's estimate is a running mean of its first trees, or twenty
        # misses would pass before a useless one stopped.
        weight = max(1 - self.smoothing, 1 / self._proposals if self.steady else 0.0)
        self.mean_accepted += weight * (accepted - self.mean_accepted)
        kept = self.smoothing if self._proposals > 1 else 0.0  # the first cost is measured
        self.cost = kept * self.cost + (1 - kept) * cost

    def expected(self, n: int) -> float:
        """Draft tokens a step with ``n`` nodes is expected to keep: a larger tree keeps at
        least what its first ``n`` nodes keep, so sizes not measured lately are bounded below by
        smaller ones."""
        return max(self.kept[:min(n, self.full) + 1])

    def record(self, drafted: int, path: Sequence[int], cost: float = 0.0) -> None:
        """Record a proposed tree of ``drafted`` nodes, drafted at ``cost`` target steps, whose
        path along the tokens committed after it is ``path`` (node indices), with what each
        size would have kept.

        Parents come before children, so a tree's first n nodes are a tree, and verifying that
        cut keeps the path up to its first node at index >= n (exactly so for greedy decoding;
        an estimate for sampling, which only steers speed). Sizes above the tree keep what it
        kept: the decoder proposes at the row's full budget, so a drafter that offered fewer
        nodes had no more to offer.
        """
        self.update(drafted, len(path), cost)
        if not drafted:
            return
        spans = list(accumulate((node + 1 for node in path), max))  # nodes each prefix spans
        # the first measurement replaces the optimistic start; a running mean over the first
        # few, then the smoothing
        weight = max(1 - self.smoothing, 1 / self._proposals)
        for n in range(1, self.full + 1):
            self.kept[n] += weight * (bisect_right(spans, n) - self.kept[n])


class TreeSizer:
    """The tree size a batch's rows draft this step: the one that brings the batch's end
    soonest per second of verification.

    A step's cost is set by its widest tree, and a batch runs until its last row is done (its
    finished rows leave it only once they are a quarter of it). So
    size ``n`` is worth ``min over rows of (1 + expected_r(n)) / remaining_r`` (the share of
    its remaining tokens the slowest row commits per step) over the step's seconds:
    ``costs.verify(1 + n)`` plus, for ``n > 0``, what drafting costs (the rows' recent trees'
    ``cost`` in plain steps: nothing for a trie, several passes for a draft model; scaled by
    what proposals were timed to take, ``StepCosts.drafting``; and a merged drafter's model's
    passes while its own budget lets it draft: a plain step spares them). ``n = 0``
    is a plain step. At batch 1 on a short prompt a wide step costs little more than a plain
    one and drafts nearly always pay; at batch 16 and a long context it costs several plain
    steps, and pays only while every row is copying. Sizes not measured yet look cheap
    (``StepCosts``' prior), so they get tried.
    Rows propose full trees and verify the chosen size; what the rest would have kept is learnt
    from the tokens committed next. While no size pays, rows still propose (without verifying)
    every ``probe_every`` steps, half as often after each such probe (down to one in
    ``max_probe_every``), and never more often than keeps probes within ``PROBE_SHARE`` of the
    plain steps' time: acceptance stays measured at a bounded cost, however dear the drafter.
    A ``steady`` drafter's probes do not back off (``STEADY_SMOOTHING``).
    """

    def __init__(self, full: int, *, adaptive: bool = True, probe_every: int = 4,
                 max_probe_every: int = 64, steady: bool = False) -> None:
        self.full = full
        self.adaptive = adaptive
        self.prober = Prober(probe_every, probe_every if steady else max_probe_every)

    def size(self, budgets: Sequence[AdaptiveBudget], remaining: Sequence[int],
             costs: StepCosts, models: float = 0.0) -> tuple[int, bool]:
        """Nodes each of the rows behind ``budgets`` (``remaining`` tokens still to go, at
        most) may verify this step, and whether they propose trees anyway: a probe, verified
        no further than the best size, whose trees are learnt from the tokens that follow.
        ``models``: what a merged drafter's model is expected to spend on the proposal, in
        plain steps (its own budget's estimate), beside what the trees' drafter spends."""
        best = self.best(budgets, remaining, costs, models)
        if best >= self.full:
            self.prober.drafted(hit=True)
            return self.full, True
        if not self.prober.due(costs.drafting(_drafting(budgets)) + models):
            self.prober.wait()
            return best, best > 0
        self.prober.drafted(hit=False)  # a probe: the trees are learnt, not verified
        return best, True

    def best(self, budgets: Sequence[AdaptiveBudget], remaining: Sequence[int],
             costs: StepCosts, models: float = 0.0) -> int:
        """The size with the highest expected rate (the larger of equals); the full budget
        when the budget is fixed, and for a batch of one row (``costs.rows``) before any cost
        is known. A larger batch takes a plain step first, timed as what every draft must beat
        (a wide step at batch 16 x 4k costs several). Drafters put their likeliest nodes first
        (a model's by path probability, merged drafts by each node's chance), so a cut keeps
        the best of a tree (docs/concepts.md, "Why the defaults")."""
        if not self.adaptive or not budgets:
            return self.full
        if costs.rows == 1 and not costs.target:
            return self.full
        if not costs.target:
            return 0
        rates = {}
        # seconds (the batch's passes are shared), the count scaled by what proposals took
        drafting = (costs.drafting(_drafting(budgets)) + models) * (costs.verify(1) or 0.0)
        for n in range(self.full + 1):
            seconds = costs.verify(1 + n)
            assert seconds is not None  # some width is measured
            if n:
                seconds += drafting
            slowest = min((1 + b.expected(n)) / max(left, 1)
                          for b, left in zip(budgets, remaining))
            rates[n] = slowest / seconds
        return max(rates, key=lambda n: (rates[n], n))  # a tie: the larger tree measures more


def _drafting(budgets: Sequence[AdaptiveBudget]) -> float:
    """What a batch's proposal costs, in plain steps: its dearest row's (passes are batched)."""
    return max((b.cost for b in budgets), default=0.0)


def _affordable_interval(cost: float) -> int:
    """Plain steps between probes costing ``cost`` plain steps that keeps them within
    ``PROBE_SHARE`` of the steps' time."""
    return math.ceil(cost / PROBE_SHARE)
