"""MagicDec's self-speculation: the target drafts for itself through a StreamingLLM view of its
own KV cache (the first ``sinks`` tokens plus a recent window, ``budget`` entries in all).

At long context the KV cache, not the weights, is what a decoding step reads; a draft pass
that reads ``budget`` entries per row costs little more than the weights, whatever the context
length, while its tokens agree with the full model's often. Nothing is prefilled twice: the
draft's passes run on the target's own cache, in a round of their own whose slots are dropped
before the target verifies (their KV entries were computed with the sparse view).

Each round drafts a chain of ``gamma`` tokens per row, ``gamma`` chosen by the policy with
MagicDec's cost model (``policy.plan.StepPlanner``) from this batch's measured pass costs and
each row's acceptance, and 0 (plain decoding) where drafting would lose; then every
``probe_every`` plain rounds a short draft measures again. Drafts carry their distributions, so
sampling is verified by multi-step speculative sampling, as for any model draft.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_spec.drafters.drafter import Capabilities, DraftRequest, TargetView
from rag_spec.drafters.model_drafter import DraftBatch, DraftPasses, ModelDrafter, SharedPasses
from rag_spec.errors import RagSpecError
from rag_spec.policy.expansion import Expansion
from rag_spec.policy.step_costs import Acceptance, StepCosts, settle
from rag_spec.target.transformers.sink_window import SinkWindow
from rag_spec.target.tree import TokenTree


class SelfSpecDrafter(ModelDrafter):
    """Drafts with the target itself, attending to ``sinks`` first tokens and the most recent
    ``budget - sinks`` of each row's committed tokens.

    Args:
        budget: KV entries a draft pass reads per row (MagicDec: 256-512).
        sinks: attention-sink tokens kept from the start of each row.
        max_gamma: longest draft chain.
        probe_every: plain rounds between probes while drafting does not pay.

    Examples:
        >>> drafter = SelfSpecDrafter(budget=256)                        # doctest: +SKIP
        >>> LookaheadDecoder(model, tok, drafter=drafter).generate(prompts)  # doctest: +SKIP
    """

    label = "self-speculation"

    def __init__(self, budget: int = 256, sinks: int = 4, *, max_gamma: int = 6,
                 probe_every: int = 8) -> None:
        if not 0 <= sinks < budget:
            msg = f"SelfSpecDrafter needs 0 <= sinks < budget (got sinks={sinks}, budget={budget})."
            raise RagSpecError(msg)
        if max_gamma < 1:
            msg = f"SelfSpecDrafter needs max_gamma >= 1 (got {max_gamma})."
            raise RagSpecError(msg)
        super().__init__(Expansion(widths=(1,), max_depth=max_gamma, adaptive_depth=False))
        self.budget = budget
        self.sinks = sinks
        self.max_gamma = max_gamma
        self.probe_every = probe_every
        self.last: SelfSpecStats | None = None  # the latest batch's costs and choices

    @property
    def capabilities(self) -> Capabilities:  # type: ignore[override]
        """Chains whose length the policy picks from the measured costs of the draft's passes
        as well as the target's, verified whole (that choice beat tree sizes at batch 16 x 4k:
        docs/concepts.md, "Why the defaults")."""
        return Capabilities(chain=self.max_gamma, chain_probes=self.probe_every)

    def propose(self, requests: Sequence[DraftRequest], target: TargetView | None
                ) -> list[TokenTree]:
        trees = super().propose(requests, target)
        if self.last is not None:  # the round's length, as the plans gave it (0: plain)
            self.last.gammas[max((r.budget for r in requests), default=0)] += 1
        return trees

    def draft_passes(self, target: TargetView, requests: Sequence[DraftRequest]
                     ) -> DraftPasses:
        """The target's own fast path through a sparse view of its cache."""
        if target.cache.window is not None:
            msg = ("SelfSpecDrafter drafts through a sparse view of full attention; this model's "
                   "layers (all or some) attend within a sliding window. Use the default "
                   "drafter.")
            raise RagSpecError(msg)
        passes = _SelfView(self, target)
        self.last = passes.stats
        return passes


@dataclass
class SelfSpecStats:
    """What a batch measured and chose: pass costs, each row's acceptance, rounds per gamma."""

    costs: StepCosts
    acceptance: list[Acceptance] = field(default_factory=list)  # the drafting rows', lately
    gammas: Counter[int] = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"target_seconds": {w: round(t, 4) for w, t in sorted(self.costs.target.items())},
                "draft_seconds": None if self.costs.draft is None else round(self.costs.draft, 4),
                "alpha": [round(a.alpha, 3) for a in self.acceptance],
                "rounds_per_gamma": dict(sorted(self.gammas.items()))}


class _SelfView(SharedPasses):
    """The target's own passes through a sink-and-window view of its cache, a chain of
    ``gamma`` tokens a round, ``gamma`` chosen from this batch's measured costs."""

    def __init__(self, drafter: SelfSpecDrafter, target: TargetView) -> None:
        # its passes are weighed by the chains' timed cost model (``self_draft_gamma``), so its
        # plans spend nothing for the row's budgets to weigh again (adaptive depth, which also
        # reads the cost, is off for its chains)
        super().__init__(target.runner, cost=0.0)
        self.drafter = drafter
        self.costs: StepCosts = target.costs
        self.stats = SelfSpecStats(self.costs)
        self.started = 0.0
        self.window: SinkWindow | None = None

    def shape(self, batch: DraftBatch, requests: Sequence[DraftRequest], expansion: Expansion
              ) -> Expansion | None:
        """A chain as long as the rows' plans say (``Capabilities.chain``), reading the
        slots of the sink-and-window view."""
        self.stats.acceptance = [r.plan.row.model for r in requests
                                 if r.budget > 0 and r.plan is not None and r.plan.row]
        gamma = min(max(r.budget for r in requests), self.drafter.max_gamma)
        cache = batch.cache
        if self.window is not None:
            self.sparse = self.window.advance(cache)
        elif bool((cache.valid.sum(dim=1) > self.drafter.budget).any()):
            # a row outgrew the budget: the view starts (before, the draft read everything)
            self.window = SinkWindow(cache, self.drafter.sinks,
                                     self.drafter.budget - self.drafter.sinks)
            self.sparse = self.window.view
        self.started, batch.passes = time.perf_counter(), 0
        return Expansion(widths=(1,), max_depth=gamma, adaptive_depth=False)

    def keep_rows(self, rows: Sequence[int]) -> None:
        if self.window is not None:
            self.window.keep_rows(rows)
            self.sparse = self.window.view

    def end_round(self, batch: DraftBatch) -> None:
        """Record what the round's passes cost."""
        settle(self.runner.device)
        self.costs.record_draft(time.perf_counter() - self.started, batch.passes)

