"""One tree from two drafters: a model's guesses and the trie's copies of the prompt, the
retrieved passages and earlier answers, under one node budget, shared prefixes verified once.

How their children mix under one parent: the model's come first, in the order it drew them
(drawn without replacement from its distribution when sampling), then the trie's, as one-hot
rows (deterministic children). Multi-step speculative sampling tries them in that order, so
each child is either a draw from the distribution its row says or a fixed token: both keep the
target's distribution. The trie also copies what followed the model's likeliest guesses
elsewhere (the guess is often right where the context alone finds no copy). A greedy row just
follows the argmax, so its tree is ordered for the sizer, which verifies a tree's first nodes:
every node ranked by its chance of being accepted (a guess's draft probability; a copy's a
fitted constant, shrinking with depth and with how often the copied token followed; a token
both proposed, the two combined).

The budget: the trie proposes first (it is cheap). The model gets what the trie left, and at
least half the budget; the trie's nodes fill the rest. A greedy row's draft head is offered the
whole budget (its pass costs the same for more nodes), and the ranking chooses among its
guesses and the copies. A model with passes of its own over the
context (a draft model, an early exit) drafts nothing while the trie offers a path of two tokens
or more (the answer is copying: its passes would cost more than they add), and is first asked at
the fourth step, by which time a copying answer has shown itself. The draft head, which reads the
target's own states (one pass a few percent of a step, no prefill), is asked from the first step,
copying or not: sparing it lost more of its hits than its passes cost, on the embedded
model's open-ended prompts (docs/concepts.md, "Why the defaults"). The model also has an
adaptive budget of its own (the row's policy holds it:
``policy.plan.RowPolicy.model_share``), fed by the tokens of its own trees the target
accepted, so while its guesses keep missing it is asked only in probe steps, and a useless
draft costs the merged drafter little over the trie alone. That budget goes on from one greedy
request to the next (``policy.plan.Policy``), probes' pace included, so a draft that missed is
not probed afresh at the fourth step of each (a draft model's probe, with its trial prefill,
costs about two steps: once per RAG answer, it put the merged drafter behind the trie alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from rag_spec.drafters.drafter import (
    Capabilities,
    Drafter,
    DraftRequest,
    DraftSession,
    TargetView,
    propose,
)
from rag_spec.drafters.model_drafter import ModelDrafter
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.policy.plan import RowPlan
from rag_spec.target.tree import TokenTree

# The model's likeliest guesses the trie extends, and the nodes it may copy after each.
_EXTENDED, _EXTENSION = 4, 4
# Chances of acceptance for ranking a greedy row's copies against the model's guesses: a copy's
# first node ranks beside a guess of this probability, each deeper node (and a copy's first
# after a guess) at a share of its parent's that grows with how far the copy has held (by its
# depth into the copy: 1, 2, 3, 4 or more), both times how often the token followed (fitted on
# recorded steps of the embedded model's head + trie: docs/concepts.md, "Copies after a guess").
_COPY_CHANCE, _DEEPER = 0.45, (0.7, 0.7, 0.8, 0.87)


class _Both:
    """A request's sessions with both drafters (how much the model drafts is the row's plan's:
    ``RowPlan.model``)."""

    def __init__(self, model: DraftSession, trie: DraftSession) -> None:
        self.model, self.trie = model, trie

    def propose(self, context: Sequence[int], budget: int) -> TokenTree:
        return self.trie.propose(context, budget)

    def observe(self, context: Sequence[int], new_from: int) -> None:
        self.model.observe(context, new_from)
        self.trie.observe(context, new_from)

    def finish(self, output: Sequence[int]) -> None:
        self.model.finish(output)
        self.trie.finish(output)

    def add_documents(self, documents: Sequence[Sequence[int]]) -> None:
        self.model.add_documents(documents)
        self.trie.add_documents(documents)


class MergedDrafter(Drafter):
    """A draft model's trees merged with the trie's.

    Examples:
        >>> drafter = MergedDrafter(EarlyExitDrafter(layers=8))             # doctest: +SKIP
        >>> LookaheadDecoder(model, tokenizer, drafter=drafter)             # doctest: +SKIP
    """

    def __init__(self, model: ModelDrafter, trie: TrieDrafter | None = None, *,
                 eager: bool = False) -> None:
        self.model = model
        self.trie = trie or TrieDrafter()
        self.eager = eager  # ask the model from the first step, not from the fourth

    @property
    def label(self) -> str:  # type: ignore[override]
        return f"{self.model.label} + {self.trie.label}"

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """The model's steadiness and features: a trained draft's hits are steady
        (``budget.STEADY_SMOOTHING``), and the trie's copies, verified for nothing beside them,
        should not stop its drafting whenever a few steps miss (docs/concepts.md, "Merged
        drafts"); the trie's row state and the model's batch state both follow kept rows."""
        model = self.model.capabilities
        return Capabilities(steady=model.steady, reads_features=model.reads_features)

    def keep_rows(self, target: TargetView, rows: Sequence[int]) -> None:
        self.model.keep_rows(target, rows)

    def end(self, target: TargetView) -> None:
        self.model.end(target)

    def session(self, prompt: Sequence[int], extra_context: Sequence[Sequence[int]] = ()
                ) -> _Both:
        return _Both(self.model.session(prompt, extra_context),
                     self.trie.session(prompt, extra_context))

    def propose(self, requests: Sequence[DraftRequest], target: TargetView | None
                ) -> list[TokenTree]:
        copies = propose(self.trie, [replace(r, session=r.session.trie) for r in requests],
                         target)
        features = self.capabilities.reads_features
        # the draft head reads the target's states: no passes of its own to spare
        plans = [r.plan.model(r.context, t, greedy=_greedy(r), eager=self.eager or features,
                              reads_features=features, steady=self.capabilities.steady,
                              costs=target.costs)
                 if r.plan is not None else RowPlan(0, 0) for r, t in zip(requests, copies)]
        guesses = propose(self.model, [replace(r, session=r.session.model, budget=plan.nodes,
                                               plan=plan)
                                       for r, plan in zip(requests, plans)], target)
        for r, plan, guess in zip(requests, plans, guesses):
            if r.plan is not None:
                r.plan.guessed(r.context, guess, plan)
        # The model's passes are weighed by its own budget (what its plan spent), so the row's
        # plan spends none: a row must not stop verifying the trie's free copies for them.
        # (The sizer still weighs them, through that budget, against a plain step that spares
        # them: ``RowPolicy.model_cost``.)
        return [_merged(guess, copy, _extensions(guess, r.session.trie, r.context), r.budget)
                for r, guess, copy in zip(requests, guesses, copies)]


def _extensions(guess: TokenTree, trie: DraftSession, context: Sequence[int]
                ) -> list[tuple[tuple[int, ...], TokenTree]]:
    """What the trie copies after each of the model's likeliest guesses (its first nodes), as
    (the guess's path, the copy after it): the guess is often right where the context has no
    copy yet, and what follows it may be copied (a name the passages spell out, a phrase the
    answer repeats)."""
    return [(path, trie.propose([*context, *path], _EXTENSION))
            for path in guess.paths[:_EXTENDED]]


def _merged(guess: TokenTree, copies: TokenTree,
            grafts: list[tuple[tuple[int, ...], TokenTree]], budget: int) -> TokenTree:
    """One tree of both drafts: the model's guesses, the trie's copies after them, then the
    trie's copies from the context. A greedy row's nodes are ranked by their chance of being
    accepted, so a cut to the tree's first nodes (the sizer's) keeps the likeliest."""
    if not len(guess):
        return copies
    extensions = TokenTree.from_paths([path + after for path, copied in grafts
                                       for after in copied.paths])
    greedy = guess.draft_probs is None and guess.scores is not None
    room = len(guess) + len(extensions) + len(copies) if greedy else budget
    tree = guess.merged(extensions, room).merged(copies, room)
    if greedy:
        followed = _followed((), copies)
        for path, copied in grafts:
            followed |= _followed(path, copied)
        tree = tree.ranked(_chances(tree, guess, followed)).first(budget)
    return tree


def _followed(prefix: tuple[int, ...], copies: TokenTree) -> dict[tuple[int, ...], float]:
    """Each copied path (after ``prefix``) with how often its last token followed the rest
    where the trie saw it (1 where the copies carry no scores; a tenth of it where only earlier
    answers hold the path: ``trie_drafter.RECALLED_TRUST``)."""
    if copies.scores is None:
        return {prefix + path: 1.0 for path in copies.paths}
    return {prefix + path: share / (copies.scores[parent] if parent >= 0 else 1.0)
            for path, share, parent in zip(copies.paths, copies.scores, copies.parents)}


def _chances(tree: TokenTree, guess: TokenTree, followed: dict[tuple[int, ...], float]
             ) -> list[float]:
    """Each node's chance of being accepted: a guess's its draft probability; a copy's first
    node ``_COPY_CHANCE``, each deeper one (and a copy's after a guess) ``_DEEPER`` of its
    parent's, times how often the copied token followed; a node both drafted, either's chance
    as independent evidence (a guess the context also copies is likelier than either says).
    Never more than the parent's."""
    assert guess.scores is not None
    known = dict(zip(guess.paths, guess.scores))
    chances: list[float] = []
    copied_depth: list[int] = []  # how far into a copy each node is (0: a guess)
    for path, parent in zip(tree.paths, tree.parents):
        above = chances[parent] if parent >= 0 else 1.0
        depth = copied_depth[parent] + 1 if parent >= 0 else 1
        copied = above * (_COPY_CHANCE if parent < 0 else _DEEPER[min(depth, len(_DEEPER)) - 1])
        copied *= followed.get(path, 1.0)
        if path in known:
            depth, drawn = 0, known[path]
            copied = 1 - (1 - drawn) * (1 - copied) if path in followed else drawn
        copied_depth.append(depth)
        chances.append(min(copied, above))
    return chances


def _greedy(request: DraftRequest) -> bool:
    return request.sampler is None or not request.sampler.params.do_sample
