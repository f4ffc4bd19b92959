"""The drafting seam: a Drafter opens a session per request and proposes one TokenTree per row
of a batch in one call.

Drafters never see target logits of the step they draft for; the verifier never knows which
drafter it talks to. A drafter that computes (a draft model, a sparse-KV self draft) reads the
target through ``TargetView``: the runner's forward (the target's weights, never a user's
module) and the batch's committed KV cache, read-only.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rag_spec.decoding.step_costs import StepCosts
from rag_spec.decoding.tree import TokenTree

if TYPE_CHECKING:
    from rag_spec.decoding.runner import Runner
    from rag_spec.decoding.sampling import RowSampler
    from rag_spec.decoding.tree_cache import TreeKVCache


class DraftSession(Protocol):
    """Drafting state for one request."""

    def propose(self, context: Sequence[int], budget: int) -> TokenTree:
        """A tree of at most ``budget`` nodes continuing ``context`` (empty when unsure)."""
        ...

    def observe(self, context: Sequence[int], new_from: int) -> None:
        """``context[new_from:]`` was just committed (accepted tokens plus the next token)."""
        ...

    def finish(self, output: Sequence[int]) -> None:
        """The request ended with ``output``; keep what is worth keeping across requests."""
        ...

    def add_documents(self, documents: Sequence[Sequence[int]]) -> None:
        """More text this request may copy from (e.g. a passage retrieved mid-generation)."""
        ...


@dataclass(frozen=True)
class DraftRequest:
    """One row's request for a draft this step."""

    session: DraftSession
    context: Sequence[int]  # committed tokens (prompt and output so far), the root last
    budget: int  # most nodes the tree may have (0: draft nothing)
    # the row's sampler: drafters that compute read its params (to process q as p is processed)
    # and draw from its draft_generator; None: greedy
    sampler: RowSampler | None = None


@dataclass(frozen=True)
class TargetView:
    """What a drafter may read of the target, for the rows of ``DraftRequest``s in order.

    The committed part of ``cache`` is read only. A drafter may run passes of the target in a
    round of its own on it (a self-draft), which it discards before returning.
    """

    runner: Runner  # forward passes through the fast path (shares the target's weights)
    cache: TreeKVCache  # committed KV entries, validity and positions of every row
    costs: StepCosts = field(default_factory=StepCosts)  # measured pass costs of this batch


@runtime_checkable
class Drafter(Protocol):
    """A source of drafts shared by requests.

    Under greedy decoding the decoder verifies the first nodes of each tree that pay for the
    batch's step (``TreeSizer``; a single row's whole while its proposals are cheap,
    ``budget.CHEAP_PROPOSAL``); a drafter that chooses its own draft lengths from measured
    step costs sets a class attribute ``sizes_own_drafts = True`` to have its trees verified
    whole. A drafter whose hits come about independently from step to step (a trained draft)
    sets ``steady = True``: its estimates average over about twenty trees
    (``budget.STEADY_SMOOTHING``), carry over from one greedy generation to the next, and a
    single row's trees are verified whole (``TreeSizer.best``). Sampled rows keep
    budgets of their own, since multi-step speculative sampling makes their tokens depend on
    the drafts; a drafter whose trees never carry ``draft_probs`` says so with
    ``draws_drafts = False``, and its sampled batches are sized as greedy ones.

    A drafter with a method ``keep_rows(cache, rows)`` lets finished rows leave a batch: the
    decoder calls it after ``TreeKVCache.keep_rows`` on the batch's cache, and the drafter keeps
    its state of that batch for ``rows`` only, in that order. Without it batches stay whole.
    """

    def session(self, prompt: Sequence[int], extra_context: Sequence[Sequence[int]] = ()
                ) -> DraftSession:
        """Open a session for a request with ``prompt`` and optional extra documents."""
        ...

    def propose(self, requests: Sequence[DraftRequest], target: TargetView | None
                ) -> list[TokenTree]:
        """One tree per request, for the whole batch at once (``target`` is None where the
        caller has no batch cache, e.g. a one-row RaLM segment)."""
        ...


def propose_each(requests: Sequence[DraftRequest]) -> list[TokenTree]:
    """Drafts from each request's own session: for drafters that draft row by row."""
    return [r.session.propose(r.context, r.budget) if r.budget > 0 else TokenTree.empty()
            for r in requests]


def propose(drafter: Any, requests: Sequence[DraftRequest], target: TargetView | None
            ) -> list[TokenTree]:
    """``drafter.propose``; drafters written before batch proposals (``session`` only) still
    work, row by row, with a DeprecationWarning."""
    batched = getattr(drafter, "propose", None)
    if batched is None:
        warnings.warn(f"{type(drafter).__name__} has no propose(requests, target); drafting row "
                      "by row. Add it (see rag_spec.decoding.drafter.Drafter).",
                      DeprecationWarning, stacklevel=3)
        return propose_each(requests)
    trees = batched(requests, target)
    if len(trees) != len(requests):
        msg = (f"{type(drafter).__name__}.propose returned {len(trees)} trees for "
               f"{len(requests)} requests; it must return one per request.")
        raise ValueError(msg)
    return trees
