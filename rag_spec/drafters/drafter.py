"""The drafting seam: a Drafter opens a session per request and proposes one TokenTree per row
of a batch in one call.

Drafters never see target logits of the step they draft for; the verifier never knows which
drafter it talks to. A drafter that computes (a draft model, a sparse-KV self draft) reads the
target through ``TargetView``: the runner's forward (the target's weights, never a user's
module) and the batch's committed KV cache, read-only.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from rag_spec.errors import RagSpecError
from rag_spec.policy.plan import RowPlan
from rag_spec.policy.step_costs import StepCosts
from rag_spec.target.tree import TokenTree

if TYPE_CHECKING:
    from rag_spec.target.sampling import RowSampler
    from rag_spec.target.transformers.runner import Runner
    from rag_spec.target.transformers.tree_cache import TreeKVCache


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
    # the row's sizing this step (``budget`` is its ``nodes``): what a drafter asks before it
    # drafts more than ``budget`` says (a model's share, a deeper pass) and tells what its
    # passes cost (``RowPlan.spend``); None where no decoder plans (no more than ``budget``)
    plan: RowPlan | None = None


@dataclass(frozen=True)
class TargetView:
    """What a drafter may read of the target, for the rows of ``DraftRequest``s in order.

    The committed part of ``cache`` is read only. A drafter may run passes of the target in a
    round of its own on it (a self-draft), which it discards before returning.
    """

    runner: Runner  # forward passes through the fast path (shares the target's weights)
    cache: TreeKVCache  # committed KV entries, validity and positions of every row
    costs: StepCosts = field(default_factory=StepCosts)  # measured pass costs of this batch


@dataclass(frozen=True)
class Capabilities:
    """What a drafter declares about its drafts. The decoder and the policy read these fields
    and nothing else about a drafter's kind; each is something the policy must know before a
    batch's first tree (how to size it, what to keep), not something it could measure from
    the trees that follow."""

    # its trees may carry ``draft_probs``: a sampled row's tokens then depend on the drafts
    # (multi-step speculative sampling), so sampled rows keep budgets of their own; False
    # (copies, sample-and-match): sampled batches are sized as greedy ones
    draws_drafts: bool = True
    # it drafts chains of at most this many tokens (0: trees), each round's length chosen by
    # the policy from measured pass costs and the rows' acceptance (MagicDec's cost model) and
    # verified whole; ``chain_probes``: plain rounds between probes while drafting loses
    chain: int = 0
    chain_probes: int = 8
    # its hits come about independently from step to step (a trained draft): estimates
    # average over about twenty trees (``budget.STEADY_SMOOTHING``) and carry over from one
    # greedy generation to the next
    steady: bool = False
    # it drafts from the target's hidden states before each root (the step keeps them)
    reads_features: bool = False
    # its batch state follows ``keep_rows``: finished rows may leave a batch
    keeps_rows: bool = True


class Drafter(abc.ABC):
    """A source of drafts shared by requests, with an explicit batch lifecycle.

    For each batch the decoder calls ``begin(target)``, then ``propose`` once a step for every
    row (each row's session ``observe``s what was committed), ``keep_rows`` when finished rows
    leave the batch (only where ``capabilities.keeps_rows``), and ``end(target)`` when the
    batch is done, however it ends. Under greedy decoding the decoder verifies the first nodes
    of each tree that pay for the batch's step (``TreeSizer``); a drafter of chains has their
    length chosen each round (``Capabilities.chain``). Each request carries its row's plan.
    """

    capabilities = Capabilities()
    label = "custom drafts"  # what drafts, in the stats and the CLI's speed line

    @abc.abstractmethod
    def session(self, prompt: Sequence[int], extra_context: Sequence[Sequence[int]] = ()
                ) -> DraftSession:
        """Open a session for a request with ``prompt`` and optional extra documents."""

    @abc.abstractmethod
    def propose(self, requests: Sequence[DraftRequest], target: TargetView | None
                ) -> list[TokenTree]:
        """One tree per request, for the whole batch at once (``target`` is None where the
        caller has no batch cache, e.g. a one-row RaLM segment)."""

    def begin(self, target: TargetView) -> None:  # noqa: B027 (most drafters keep no batch state)
        """A batch starts on ``target``'s cache."""

    def keep_rows(self, target: TargetView, rows: Sequence[int]) -> None:  # noqa: B027
        """The batch on ``target`` goes on with only ``rows``, in that order
        (``TreeKVCache.keep_rows`` was called): batch state follows."""

    def end(self, target: TargetView) -> None:  # noqa: B027
        """The batch on ``target`` is done: its state goes."""


def propose_each(requests: Sequence[DraftRequest]) -> list[TokenTree]:
    """Drafts from each request's own session: for drafters that draft row by row."""
    return [r.session.propose(r.context, r.budget) if r.budget > 0 else TokenTree.empty()
            for r in requests]


def propose(drafter: Drafter, requests: Sequence[DraftRequest], target: TargetView | None
            ) -> list[TokenTree]:
    """``drafter.propose``, checked to return one tree per request."""
    trees = drafter.propose(requests, target)
    if len(trees) != len(requests):
        msg = (f"{type(drafter).__name__}.propose returned {len(trees)} trees for "
               f"{len(requests)} requests; it must return one per request.")
        raise ValueError(msg)
    return trees


def check_drafter(drafter: object) -> None:
    """Refuse what does not declare the protocol, before any generation starts."""
    if not isinstance(drafter, Drafter):
        msg = (f"{type(drafter).__name__} is not a Drafter: subclass rag_spec.Drafter (declare "
               f"its capabilities, implement session and propose).")
        raise RagSpecError(msg)
