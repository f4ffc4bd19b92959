"""A batch in flight, and the one speculative step its rows take: plan, draft, verify in one
forward pass, accept, compact.

Rows join a batch between steps and leave it when they end (continuous batching):
``LookaheadDecoder.generate`` runs a batch that only its own prompts join, a server keeps one
open while requests come and go (``rag_spec.serving.scheduler``). A join prefills the
newcomers on their own, then copies the batch's committed entries and theirs into one cache
(``prefill.regroup``: each row right-aligned, its holes masked, its positions unchanged), and
finished rows leave at the same time. The drafter's batch state is rebuilt over the new cache
(``Drafter.end``, ``begin``); each row's own drafting state (its session) carries on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rag_spec.drafters.drafter import Drafter, DraftRequest, DraftSession, TargetView, propose
from rag_spec.engine.stopping import StopRule
from rag_spec.engine.streaming import TextStream
from rag_spec.engine.verify.grammar import Constraint
from rag_spec.engine.verify.verify import verify
from rag_spec.policy.plan import Policy, RowPlan, RowPolicy, StepPlanner, cache_room, cache_slots
from rag_spec.policy.step_costs import settle
from rag_spec.target.sampling import RowSampler
from rag_spec.target.transformers.kv_cache import SlidingWindow
from rag_spec.target.transformers.prefill import prefill, prefill_reusing, prefill_whole, regroup
from rag_spec.target.transformers.prefix_store import PrefixStore
from rag_spec.target.transformers.runner import Runner
from rag_spec.target.transformers.step_inputs import tree_step
from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec.target.tree import TokenTree

# a row a caller stopped (``Row.cancel``): it ends at the next step
CANCELLED = "cancelled"


@dataclass
class DecodeStats:
    """Where a generation's steps and time went."""

    drafts: str = ""  # what drafted (``Drafter.label``): "draft head + trie", "trie", ...
    # how the steps' passes ran: "compiled ahead of time" (a package this machine holds),
    # "compiled" (torch.compile in this process), "eager"
    passes: str = ""
    # what the linear layers multiplied by: "GGUF" (a GGUF file's own quantised blocks,
    # ``LookaheadConfig.quantized``) or the model's dtype ("float32": ``generate``'s numbers)
    weights: str = ""
    steps: int = 0
    drafted: int = 0  # draft nodes verified, all steps
    accepted_per_step: list[int] = field(default_factory=list)  # draft tokens kept (no bonus)
    prefill_seconds: float = 0.0  # before the first step: drafter sessions and the prefill
    # prompt tokens whose entries were read from the decoder's stored prefixes, not computed
    # (``LookaheadConfig.prefix_cache_mb``)
    cached_prompt_tokens: int = 0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per forward pass (accepted drafts plus the bonus)."""
        return (sum(self.accepted_per_step) + self.steps) / max(self.steps, 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_step": round(self.tokens_per_step, 3)}


@dataclass
class GenerationResult:
    """New tokens only (prompt excluded), their text, and how they were produced."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "stop" or "length" ("cancelled": ``Row.cancel``)
    stats: DecodeStats
    # constrained output that ended before its grammar was complete (cut at the token limit):
    # not valid under the grammar (``IncompleteOutputWarning``)
    incomplete: bool = False


@dataclass(eq=False)
class Row:
    """One request in flight: its prompt, drafting state, sampler, stop rule and output."""

    prompt: list[int]
    session: DraftSession
    policy: RowPolicy  # the request's estimates: what sizes its trees
    sampler: RowSampler
    rule: StopRule
    remember: bool = True  # hand the finished output to the drafter's cross-request memory
    constraint: Constraint | None = None  # the grammar the output follows, if any
    stream: TextStream | None = None  # where its settled text goes, step by step
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    created: float = field(default_factory=time.perf_counter)
    cancelled: bool = False  # asked to stop (``cancel``); the batch ends it at its next step

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output

    def cancel(self) -> None:
        """End this row at the batch's next step (a client that went away); from any thread."""
        self.cancelled = True

    def result(self) -> GenerationResult:
        text = self.rule.final_text(self.output) if self.rule.tokenizer is not None else ""
        return GenerationResult(self.output, text, self.finish_reason or "length", self.stats,
                                self.constraint is not None and not self.constraint.complete)


class LiveBatch:
    """Rows decoding together on one cache; ``join`` adds rows between steps, ``step`` runs
    one speculative step for all of them, ``close`` ends the batch. One thread at a time.

    Examples:
        >>> batch = decoder.open_batch()                                  # doctest: +SKIP
        >>> rows = decoder.new_rows([first, second], 64)                  # doctest: +SKIP
        >>> batch.join(rows[:1]); batch.step()                            # doctest: +SKIP
        >>> batch.join(rows[1:])  # joins the first, mid-answer           # doctest: +SKIP
        >>> while batch.live: batch.step()                                # doctest: +SKIP
        >>> batch.close(); rows[1].result().text                          # doctest: +SKIP
    """

    def __init__(self, runner: Runner, drafter: Drafter, policy: Policy, budget: int,
                 window: SlidingWindow | None, *, greedy: bool,
                 release: Callable[[], None] | None = None,
                 prefixes: PrefixStore | None = None) -> None:
        self.runner = runner
        self.drafter = drafter
        self.policy = policy
        self.budget = budget
        self.window = window
        self.greedy = greedy
        self.rows: list[Row] = []  # in the cache's order, finished rows until they leave
        self.target: TargetView | None = None
        self.planner: StepPlanner | None = None
        self.passes = "eager"
        self._ended: list[RowPolicy] = []  # the estimates of rows that ended (``close``)
        self._release = release  # called once the batch is closed (its decoder is free)
        self.prefixes = prefixes  # prompts' stored entries, where reading them is lossless

    @property
    def live(self) -> list[Row]:
        """Rows still decoding."""
        return [r for r in self.rows if r.finish_reason is None]

    @property
    def steady(self) -> bool:
        return self.drafter.capabilities.steady

    def join(self, rows: Sequence[Row]) -> list[Row]:
        """Prefill ``rows`` and add them: from the next step on they decode with the others
        (finished rows leave now). With exact numerics the prefill commits their first
        tokens; returns the rows that ended there."""
        if not rows:
            return []
        runner, staying = self.runner, self.live
        with torch.inference_mode():
            if self.target is None or not staying:
                everyone = list(rows)
                capacity = self._capacity(everyone, max(len(r.prompt) for r in rows))
                cache = self._prefilled(rows, capacity)
            else:  # between steps: the old rows' entries and the newcomers' into one cache
                old = self.target.cache
                part = self._prefilled(rows, None)
                keep = [b for b, r in enumerate(self.rows) if r.finish_reason is None]
                everyone = [*staying, *rows]
                capacity = self._capacity(everyone, max(old.length, part.length) + 1)
                cache = regroup(runner, [(old, keep), (part, range(len(rows)))], capacity)
            if self.target is not None:
                self._close_target()
            self.passes = runner.compiled.kind if capacity is not None and \
                runner.compiled is not None else "eager"
            self._open_target(cache, everyone)
        now = time.perf_counter()
        for row in rows:
            row.stats.prefill_seconds = now - row.created
            row.stats.passes, row.stats.weights = self.passes, runner.weights
            row.stats.drafts = self.drafter.label
            if runner.exact and row.stream is not None:
                row.stream.update(row.output, row.finish_reason is not None)
        ended = [r for r in rows if r.finish_reason is not None]
        self._ended.extend(r.policy for r in ended)
        return ended

    def step(self) -> list[Row]:
        """One speculative step for every live row; returns the rows it ended (cancelled
        ones included), which leave at the next join or compaction."""
        assert self.target is not None and self.planner is not None
        cancelled = [r for r in self.rows if r.cancelled and r.finish_reason is None]
        for row in cancelled:
            row.finish_reason, row.remember = CANCELLED, False
        live = [r.finish_reason is None for r in self.rows]
        if any(live):
            speculative_step(self.rows, self.target, self.planner, self.drafter, self.budget)
        for row, on in zip(self.rows, live):
            if on and row.stream is not None:
                row.stream.update(row.output, row.finish_reason is not None)
        ended = cancelled + [r for r, on in zip(self.rows, live)
                             if on and r.finish_reason is not None]
        self._ended.extend(r.policy for r in ended)
        self._without_finished()
        return ended

    def close(self) -> None:
        """The batch is done: its cache goes back, its estimates carry over to the next."""
        if self.target is not None:
            self._close_target()
            self.target = None
        self.policy.ended(self._ended, greedy=self.greedy, steady=self.steady)
        self._ended = []
        release, self._release = self._release, None
        if release is not None:
            release()

    def _prefilled(self, rows: Sequence[Row], capacity: int | None) -> TreeKVCache:
        """A cache of ``rows``' prompts (a static one of ``capacity`` slots where given)."""
        prompts = [r.prompt for r in rows]
        if self.prefixes is not None:
            cache, read = prefill_reusing(self.runner, prompts, self.prefixes, capacity)
            for row, tokens in zip(rows, read):
                row.stats.cached_prompt_tokens = tokens
            return cache
        if not self.runner.exact:
            return prefill(self.runner, prompts, capacity)
        cache, logits = prefill_whole(self.runner, prompts)  # generate's own prefill
        first_tokens(rows, cache, logits, self.budget)
        return cache

    def _capacity(self, rows: Sequence[Row], longest: int) -> int | None:
        """Slots of a static cache for a compiled runner (``plan.cache_slots``) holding
        ``longest`` slots now; None (a growing cache) without one, or for a sliding window,
        which the static cache does not hold."""
        compiled = self.runner.compiled
        if compiled is None or self.window is not None:
            return None
        behind = max(r.rule.max_new_tokens - len(r.output) for r in rows)
        return compiled.capacity(cache_slots(longest, behind, len(rows), self.budget))

    def _open_target(self, cache: TreeKVCache, rows: list[Row]) -> None:
        self.rows = rows
        self.target = TargetView(self.runner, cache, self.policy.costs(
            self.runner, len(rows), self.passes, steady=self.steady))
        declared = self.drafter.capabilities
        self.planner = self.policy.planner(
            greedy=self.greedy, draws_drafts=declared.draws_drafts,
            constrained=any(r.constraint for r in rows), steady=self.steady,
            chain=declared.chain, chain_probes=declared.chain_probes)
        self.drafter.begin(self.target)

    def _close_target(self) -> None:
        """Also when a stream is left unfinished: the next generation replays graphs."""
        assert self.target is not None
        self.drafter.end(self.target)
        self.runner.release(self.target.cache)
        self.policy.measured(self.runner, self.passes, self.target.costs)

    def _without_finished(self) -> None:
        """The batch without its finished rows once they are a quarter of it: their entries
        leave the cache (the others' are copied once), so later passes stop reading and
        computing them. Where the drafter's state follows (``Capabilities.keeps_rows``) and
        the cache grows; otherwise they leave at the next join."""
        assert self.target is not None
        keep = [b for b, r in enumerate(self.rows) if r.finish_reason is None]
        cache = self.target.cache
        if not keep or 4 * (len(self.rows) - len(keep)) < len(self.rows) \
                or not self.drafter.capabilities.keeps_rows or cache.capacity is not None:
            return
        with torch.inference_mode():
            cache.keep_rows(keep)
            self.drafter.keep_rows(self.target, keep)
        self.rows = [self.rows[b] for b in keep]


@torch.inference_mode()
def speculative_step(rows: Sequence[Row], target: TargetView, planner: StepPlanner,
                     drafter: Drafter, budget: int) -> None:
    """One step for every row: plan, draft, verify in one forward pass, accept, compact."""
    cache, runner = target.cache, target.runner
    # 1. Draft: a tree per unfinished row (finished rows ride along with no draft until
    # they leave the batch). Rows propose their plan's trees and verify their first nodes:
    # what the rest would have kept is learnt from the tokens committed next.
    t0 = time.perf_counter()
    active = [r.finish_reason is None for r in rows]
    plans = planner.plan(
        [r.policy if on else None for r, on in zip(rows, active)],
        [r.rule.max_new_tokens - len(r.output) for r, on in zip(rows, active) if on],
        target.costs, _room(cache, rows, budget))
    requests = [DraftRequest(r.session, r.context, plan.nodes, r.sampler, plan)
                for r, plan in zip(rows, plans)]
    proposals = [tree if on else TokenTree.empty() for tree, on in zip(
        propose(drafter, requests, target), active)]
    # a grammar cuts the drafts it forbids and drafts what it forces
    proposals = [r.constraint.drafts(tree, plan.verify) if on and r.constraint else tree
                 for r, tree, plan, on in zip(rows, proposals, plans, active)]
    trees = [tree.first(plan.verify) for tree, plan in zip(proposals, plans)]
    # 2. Forward: one pass over every row's root and tree.
    t1 = time.perf_counter()
    target.costs.record_proposal(max(p.spent + p.model_spent for p in plans), t1 - t0)
    logits = runner.forward(cache, tree_step(cache, trees, runner.dtype),
                            features=drafter.capabilities.reads_features)
    # the grammars' masks are filled on the CPU while an accelerator runs the pass
    masks = [_masks(row, tree) for row, tree in zip(rows, trees)]
    settle(runner.device)  # the cost model needs the pass's time, not its launch's
    t2 = time.perf_counter()
    target.costs.record_target(1 + max(len(t) for t in trees), t2 - t1)
    # 3. Verify: each row's accepted path and the target's next token after it.
    verdicts = [verify(_allowed(row, logits[b, :1 + len(tree)], mask), tree,
                       row.sampler, row.context, len(row.output))
                for b, (row, tree, mask) in enumerate(zip(rows, trees, masks))]
    for row, tree, proposal, plan, verdict, on in zip(
            rows, trees, proposals, plans, verdicts, active):
        if on:
            _commit(row, verdict.tokens, len(tree), proposal, plan, budget)
    # 4. Roll back: keep only the accepted slots of the KV cache.
    cache.keep([v.path for v in verdicts], [v.next_token for v in verdicts])
    t3 = time.perf_counter()
    for row, on in zip(rows, active):
        if on:
            row.stats.draft_seconds += t1 - t0
            row.stats.forward_seconds += t2 - t1
            row.stats.bookkeeping_seconds += t3 - t2


def first_tokens(rows: Sequence[Row], cache: TreeKVCache, logits: torch.Tensor,
                 budget: int) -> None:
    """Commit each row's first token, chosen from the logits after its whole prompt; it
    becomes the row's root."""
    empty = TokenTree.empty()
    verdicts = [verify(_allowed(row, logits[b:b + 1], _masks(row, empty)), empty,
                       row.sampler, row.context, 0) for b, row in enumerate(rows)]
    for row, verdict in zip(rows, verdicts):
        _commit(row, verdict.tokens, 0, empty, RowPlan(0, 0), budget)
    cache.roots = [v.next_token for v in verdicts]


def _commit(row: Row, tokens: list[int], drafted: int, proposal: TokenTree, plan: RowPlan,
            budget: int) -> None:
    """Append tokens one by one until the stop rule fires; teach the drafter what was kept,
    and the row's estimates what the proposals would have kept."""
    before = len(row.context)
    for token in tokens:
        row.output.append(token)
        row.finish_reason = row.rule.finish_reason(row.output)
        if row.finish_reason is not None:
            break
    if row.constraint is not None:
        row.constraint.advance(row.context[before:])
    row.stats.steps += 1
    row.stats.drafted += drafted
    row.stats.accepted_per_step.append(len(tokens) - 1)
    row.policy.proposed(proposal, before, plan.spent)
    row.policy.learn(row.context, row.finish_reason is not None)
    if budget:  # a drafter learns only to draft
        row.session.observe(row.context, before)
    if row.finish_reason is not None and row.remember:
        row.session.finish(row.output)


def _room(cache: TreeKVCache, rows: Sequence[Row], budget: int) -> int | None:
    """The most tree nodes a step may verify on a static cache (``plan.cache_room``; None:
    a growing cache)."""
    if cache.capacity is None:
        return None
    behind = max((r.rule.max_new_tokens - len(r.output) for r in rows
                  if r.finish_reason is None), default=0)
    return cache_room(cache.capacity - cache.length, behind, budget)


def _masks(row: Row, tree: TokenTree) -> torch.Tensor | None:
    """A row's grammar's bitmask over ``tree`` (None: no grammar, or the row has finished)."""
    if row.constraint is None or row.finish_reason is not None:
        return None
    return row.constraint.masks(tree)


def _allowed(row: Row, logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A row's logits [1 + n, vocab], masked by its grammar along each node's path."""
    return logits if row.constraint is None or mask is None else \
        row.constraint.apply(logits, mask)
