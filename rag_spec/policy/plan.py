"""Every sizing decision of a step, from one place.

The decoder asks ``StepPlanner.plan`` once a step and hands each row's ``RowPlan`` to the
drafter with its request; nothing else sizes. A plan says how many nodes a row proposes and
how many of them the step verifies; through it a drafter asks what it may draft beyond that
(a merged drafter's model share, a model draft's next depth) and reports what its drafting
took. What a request has learnt lives in its ``RowPolicy``; what carries over from one request
to the next lives in the decoder's ``Policy``, once.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_spec.policy.budget import (
    AdaptiveBudget,
    Prober,
    TreeSizer,
    merged_share,
    self_draft_gamma,
    trial_pays,
)
from rag_spec.policy.expansion import Expansion
from rag_spec.policy.step_costs import Acceptance, StepCosts
from rag_spec.target.tree import TokenTree

# A trie path this deep means the answer is copying (a passage, the prompt, an earlier answer):
# a merged drafter's model, if it has passes of its own, is spared.
COPYING = 2


class RowPolicy:
    """One request's estimates, from its first step to its last (and across a RaLM request's
    segments): the tree's budget (``AdaptiveBudget``: nodes kept by size, drafting cost,
    probes), a model's own drafts (``Acceptance``: per token, per round, in all), and, under a
    merged drafter, the model's own budget, which stops its drafting (and its passes) while its
    guesses miss even when the trie's copies keep the tree's budget up."""

    def __init__(self, budget: AdaptiveBudget, source: AdaptiveBudget | None = None) -> None:
        self.budget = budget
        self.model = Acceptance()
        # a merged drafter's model budget: the carried one, or made at its first share
        self.source = source
        self.merged = False  # under a merged drafter: the model learns from its guesses alone
        self._guess: tuple[TokenTree, int, float] | None = None  # tree, context length, cost
        # proposed trees, each with the context length it continues and what drafting it
        # took, until what they would have kept is known
        self._proposals: list[tuple[TokenTree, int, float]] = []

    def proposed(self, tree: TokenTree, start: int, cost: float) -> None:
        """A step proposed ``tree`` after the first ``start`` tokens, drafted at ``cost``."""
        self._proposals.append((tree, start, cost))

    def learn(self, context: Sequence[int], finished: bool) -> None:
        """Record what each proposal would have kept, as soon as the tokens committed after it
        settle that (or the row has finished): for greedy decoding, exactly the path its
        verification would have accepted, whatever part of it was verified.

        The path is settled once the committed tokens leave the tree (a token no child has) or
        reach a leaf; a proposal that missed at its root is thus learnt from on the very step
        that verified it, before the next step drafts again at the old, optimistic estimate."""
        while self._proposals:
            proposal, start, cost = self._proposals[0]
            committed = context[start:]
            path = proposal.follow(committed)
            settled = len(path) < len(committed) or not proposal.children(
                path[-1] if path else -1)
            if not finished and not settled:
                return
            self._proposals.pop(0)
            self.budget.record(len(proposal), path, cost)
            if len(proposal) and not self.merged:  # the tree is the model's own
                self.model.record(int(proposal.depths.max()), len(path))

    def model_share(self, context: Sequence[int], budget: int, copies: TokenTree, *,
                    greedy: bool, eager: bool, reads_features: bool, steady: bool,
                    costs: StepCosts | None = None) -> int:
        """Nodes a merged drafter's model may draft this step beside the trie's ``copies``,
        after learning what its last guess earned. A model with passes of its own over the
        context drafts nothing while the trie's copies run two tokens deep (the answer is
        copying), and unless ``eager`` waits for its budget's first probe (the fourth step).
        A head on the target's states (``reads_features``) of a ``greedy`` row is offered the
        whole budget (``budget.merged_share``). The model's passes are counted by the
        weights they read; for a greedy row ``costs`` scales that count by what proposals were
        timed to take (``StepCosts.drafting``): per-pass overheads, and a target whose step
        reads fewer bytes a weight (a GGUF file's), make a pass dearer than its weights say. A
        sampled row's tokens depend on its drafts, so its count stays untimed: the same seed
        samples the same tokens in a batch and alone."""
        if self.source is None:
            self.source = AdaptiveBudget(1, initial=1.0 if eager else 0.0, steady=steady)
        if self._guess is not None:
            guess, start, cost = self._guess
            accepted = len(guess.follow(context[start:]))
            timed = costs is not None and greedy  # a sampled row's drafts stay reproducible
            self.source.update(max(len(guess), 1), accepted,
                               costs.drafting(cost) if timed else cost)
            if len(guess):
                self.model.record(int(guess.depths.max()), accepted)
            self._guess = None
        else:
            self.source.update(0, 0)  # an idle step: counts toward the next probe
        copying = len(copies) > 0 and copies.depths.max() >= COPYING
        if not self.source.current or (not reads_features and copying):
            return 0
        return merged_share(budget, len(copies), ranked=greedy and reads_features)

    def guessed(self, context: Sequence[int], guess: TokenTree, cost: float) -> None:
        """The merged drafter's model proposed ``guess`` after ``context`` at ``cost``."""
        self._guess = (guess, len(context), cost)

    @property
    def model_cost(self) -> float:
        """What a merged drafter's model is expected to spend on this row's next proposal:
        its recent guesses' cost while its budget lets it guess (a greedy row's, in plain
        steps as timed; the sizer weighs greedy rows only), else nothing."""
        source = self.source
        return source.cost if source is not None and source.current else 0.0


@dataclass
class RowPlan:
    """One row's sizing for one step, handed to its drafter with its request."""

    nodes: int  # most nodes the drafter may propose (0: draft nothing)
    verify: int  # most of the proposed tree's first nodes the step verifies
    row: RowPolicy | None = None  # the request's estimates (None: a caller without a policy)
    spent: float = field(default=0.0, compare=False)  # drafting's cost, in target steps
    # a merged drafter's model's cost this step (its own budget weighs it), in target steps
    model_spent: float = field(default=0.0, compare=False)

    def spend(self, steps: float) -> None:
        """The drafter's passes for this plan cost ``steps`` one-token target steps (counted by
        the weights they read): the policy weighs drafts against what they take."""
        self.spent += steps

    def grows(self, expansion: Expansion, depth: int, nodes: int, likeliest: float,
              cost: float) -> bool:
        """Whether a model's tree, ``nodes`` drafted, gets a pass below ``depth`` (its best new
        node ``likeliest`` by path probability; a pass costs ``cost`` target steps)."""
        mean = self.row.model.mean if self.row is not None else 1.0
        return expansion.grows(depth, nodes, self.nodes, likeliest, mean, cost)

    def model(self, context: Sequence[int], copies: TokenTree, *, greedy: bool, eager: bool,
              reads_features: bool, steady: bool, costs: StepCosts | None = None) -> RowPlan:
        """The plan of a merged drafter's model beside the trie's ``copies``
        (``RowPolicy.model_share``); what the model spends is its own budget's to weigh, in
        plain steps as ``costs`` measured them where given."""
        if self.row is None:
            return RowPlan(0, 0)
        self.row.merged = True
        if not self.nodes:
            return RowPlan(0, 0, self.row)
        share = self.row.model_share(context, self.nodes, copies, greedy=greedy, eager=eager,
                                     reads_features=reads_features, steady=steady, costs=costs)
        return RowPlan(share, share, self.row)

    def guessed(self, context: Sequence[int], guess: TokenTree, model: RowPlan) -> None:
        """The model drafted ``guess`` under ``model`` (its plan from ``model``)."""
        if self.row is not None and model.nodes:
            self.model_spent = model.spent
            self.row.guessed(context, guess, model.spent)


def trial_paid(plans: Sequence[RowPlan]) -> bool:
    """Whether a draft model on trial has kept enough of its drafts, over the batch's rows, to
    read their contexts whole (``budget.trial_pays``)."""
    models = [p.row.model for p in plans if p.row is not None]
    return trial_pays(sum(m.kept for m in models), sum(m.rounds for m in models))


class StepPlanner:
    """One batch's steps: each row's plan from its estimates, the batch's measured costs and
    the room left in its cache.

    A ``sized`` batch verifies the first nodes of its rows' trees that pay for its steps
    (``TreeSizer``); otherwise each row verifies what its own budget proposes. A drafter of
    chains (``chain``: their longest) drafts each round the length with the best expected rate
    by the measured pass costs and the rows' acceptance (MagicDec's cost model,
    ``budget.self_draft_gamma``), probing every ``chain_probes`` plain rounds while none pays,
    and its chains are verified whole.
    """

    def __init__(self, full: int, *, sized: bool, adaptive: bool = True, steady: bool = False,
                 chain: int = 0, chain_probes: int = 8) -> None:
        self.full = full
        self.sizer = TreeSizer(full, adaptive=adaptive, steady=steady) if sized else None
        self.chain = chain
        self.chain_prober = Prober(chain_probes, chain_probes)  # a steady pace

    def plan(self, rows: Sequence[RowPolicy | None], remaining: Sequence[int],
             costs: StepCosts, room: int | None = None) -> list[RowPlan]:
        """A plan per row (None: a finished row, which drafts nothing), ``remaining`` tokens
        to go at most for each unfinished one; ``room``: the most nodes the cache takes."""
        live = [r for r in rows if r is not None]
        cap, propose = (self.full, True) if self.sizer is None else self.sizer.size(
            [r.budget for r in live], remaining, costs,
            max((r.model_cost for r in live), default=0.0))
        if room is not None:
            cap = min(cap, room)
        nodes = [r.budget.current if r is not None and propose else 0 for r in rows]
        if self.chain:
            drafting = [r.model.alpha for r, n in zip(rows, nodes) if r is not None and n]
            gamma = self_draft_gamma(costs, drafting, self.chain, self.chain_prober) \
                if drafting else 0
            nodes = [min(n, gamma) for n in nodes]
        return [RowPlan(n, cap, r) for n, r in zip(nodes, rows)]


class Policy:
    """A decoder's sizing across requests: each new request's estimates, and what carries over.

    A steady drafter's estimates (a trained draft's) belong to the drafter and the model more
    than to one request, so a greedy request starts from where the last ended
    (``AdaptiveBudget.resumed``), and so do its batches' measured pass costs; so does a merged
    drafter's model budget, its probes' pace included (a draft model's first probe, with its
    trial prefill, costs about two steps, so a draft that missed is not probed afresh at the
    fourth step of each request). Sampled requests start afresh: the tokens they sample depend
    on their trees, never on what ran before.
    """

    def __init__(self, full: int, *, adaptive: bool = True) -> None:
        self.full = full
        self.adaptive = adaptive
        self._rows: AdaptiveBudget | None = None  # a steady drafter's, as the last ended
        self._model: AdaptiveBudget | None = None  # a merged drafter's model budget, likewise
        # measured target pass seconds by width, per (rows, how passes ran), for the runner
        # they were measured on (held weakly: a replaced model's runner goes)
        self._runner: Any = lambda: None
        self._measured: dict[tuple[int, str], dict[int, float]] = {}

    def row(self, *, greedy: bool, steady: bool) -> RowPolicy:
        """A new request's estimates."""
        if greedy and steady and self._rows is not None:
            budget = self._rows.resumed()
        else:
            budget = AdaptiveBudget(self.full, adaptive=self.adaptive, steady=steady)
        carried = self._model.carried() if greedy and self._model is not None else None
        return RowPolicy(budget, carried)

    def ended(self, rows: Sequence[RowPolicy], *, greedy: bool, steady: bool) -> None:
        """Requests ended: a greedy batch's estimates carry over (the row that saw most)."""
        if not greedy or not rows:
            return
        if steady:
            self._rows = max((r.budget for r in rows), key=lambda b: b.trees)
        models = [r.source for r in rows if r.source is not None]
        if models:
            self._model = max(models, key=lambda b: b.trees)

    def costs(self, runner: object, rows: int, passes: str, *, steady: bool) -> StepCosts:
        """A new batch's pass costs: for a steady drafter, what earlier batches of as many
        rows measured on ``runner``'s ``passes``; others size from their own batch's."""
        if self._runner() is not runner:
            self._runner, self._measured = weakref.ref(runner), {}
        measured = self._measured.get((rows, passes), {})
        return StepCosts(rows=rows, target=dict(measured) if steady else {})

    def measured(self, runner: object, passes: str, costs: StepCosts) -> None:
        """A batch on ``runner``'s ``passes`` ended with ``costs`` measured."""
        if self._runner() is runner:
            self._measured.setdefault((costs.rows, passes), {}).update(costs.target)

    def planner(self, *, greedy: bool, draws_drafts: bool, constrained: bool, steady: bool,
                chain: int = 0, chain_probes: int = 8) -> StepPlanner:
        """A batch's planner. Greedy output never depends on the drafts, so the batch may size
        its rows' trees; nor does sampled output under drafts that are not drawn
        (sample-and-match). A sampled row's does under multi-step speculative sampling: it
        keeps its own budget, so it samples the same tokens in any batch. A drafter that sizes
        its drafts from measured costs itself (``sizes_own_drafts``) is left to do so. Under a
        grammar a row verifies its own budget: the tokens the grammar forces into its trees
        cost no drafting."""
        sized = (greedy or not draws_drafts) and not chain and not constrained
        return StepPlanner(self.full, sized=sized, adaptive=self.adaptive, steady=steady,
                           chain=chain, chain_probes=chain_probes)

    def segment(self) -> RowPolicy:
        """Estimates for a request decoded segment by segment (iterative RaLM), carried across
        its segments."""
        return RowPolicy(AdaptiveBudget(self.full, adaptive=self.adaptive))

    def segment_planner(self, *, chain: int = 0, chain_probes: int = 8) -> StepPlanner:
        """A segment's planner: its one row verifies what its own budget proposes (chains
        sized as in ``planner``)."""
        return StepPlanner(self.full, sized=False, adaptive=self.adaptive, chain=chain,
                           chain_probes=chain_probes)


def cache_slots(longest_prompt: int, answer: int, rows: int, full: int) -> int:
    """Slots a static cache needs: the longest prompt (shorter ones are left-padded), its
    answer, and a round (a draft's passes, then roots and trees: twice a step at most). Rows
    that accept unequal paths leave holes in each other's slots: a batch gets an answer's
    length more for them (``cache_room`` keeps any batch inside)."""
    holes = answer if rows > 1 else 0
    return longest_prompt + answer + holes + 2 * (full + 1)


def cache_room(free: int, behind: int, full: int) -> int:
    """The most tree nodes a step may verify with ``free`` slots left in a static cache, so
    that every row can still finish inside it. A step takes as many slots as its longest
    accepted path, so rows that accept less leave holes; this keeps room for the furthest
    ``behind`` (tokens still to go) to finish one token a step, and for a draft's passes (a
    round of up to ``full`` nodes) besides: one row never loses nodes to it, a batch only once
    its holes have used the answer's length it was given."""
    return max(0, free - behind - full - 2)
