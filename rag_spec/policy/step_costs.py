"""MagicDec's cost model: how many tokens to draft per step, from measured step costs.

A round drafts ``gamma`` tokens per row (``gamma`` draft passes), then verifies them in one
target pass of ``gamma + 1`` tokens per row. With per-token acceptance ``alpha`` a row commits
``(1 - alpha**(gamma + 1)) / (1 - alpha)`` tokens per round, so the batch's rate is

    sum over rows of expected_tokens(gamma, alpha_row) / (gamma * draft + verify(gamma + 1))

and ``gamma = 0`` is plain decoding (one token per row per ``verify(1)``). Every cost is
measured on the batch being decoded, so the choice follows its batch size and context length
(the draft pass reads a bounded KV view, the target pass all of it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# A pass width not measured yet costs this much more per extra token than the nearest measured
# one (relative to a one-token pass): optimistic, so unmeasured widths get tried and measured.
# One row pays little per token (the step reads the weights either way); a batch pays for each
# of its rows: an extra token per row is ``rows`` more rows through every linear layer and
# more attention (measured at 16 x 4k on two cores: about the per-row prior below).
_PRIOR_SLOPE = 0.05
_PRIOR_SLOPE_PER_ROW = 0.015
_SMOOTHING = 0.7


def prior_cost(width: int, rows: int = 1) -> float:
    """A pass ``width`` tokens wide per row of ``rows``, in one-token passes of those rows,
    before any is measured."""
    return 1.0 + max(_PRIOR_SLOPE, _PRIOR_SLOPE_PER_ROW * rows) * (width - 1)


def expected_tokens(gamma: int, alpha: float) -> float:
    """Tokens a row commits per round: accepted draft tokens plus the target's own one."""
    if alpha >= 1.0:
        return gamma + 1.0
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


@dataclass
class StepCosts:
    """Smoothed seconds of a batch's forward passes: target passes by width (tokens per row),
    and one draft pass."""

    target: dict[int, float] = field(default_factory=dict)
    rows: int = 1  # the batch's rows: what unmeasured widths are estimated for
    draft: float | None = None
    # seconds a proposal took per target step its tree's count (weights read) says it costs
    counted_step: float | None = None
    # the costs timed at least once: a first timing is a warm-up and is not counted
    _timed: set[int | str] = field(default_factory=set, repr=False)
    # unmeasured widths' estimates since the last timing (a sizer asks for every width a step)
    _estimates: dict[int, float] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self._timed.update(self.target)  # costs given are measured ones

    def record_target(self, width: int, seconds: float) -> None:
        if self._warm(width):
            self.target[width] = _smooth(self.target.get(width), seconds)
            self._estimates.clear()

    def record_draft(self, seconds: float, passes: int) -> None:
        if passes and self._warm("draft"):
            self.draft = _smooth(self.draft, seconds / passes)

    def record_proposal(self, counted: float, seconds: float) -> None:
        """A proposal whose trees were counted at ``counted`` target steps took ``seconds``."""
        if counted > 0 and self._warm("proposal"):
            self.counted_step = _smooth(self.counted_step, seconds / counted)

    def _warm(self, key: int | str) -> bool:
        """Whether ``key``'s cost was timed before. The first pass of a width (or a draft, or
        a proposal) pays one-off work: kernels picked or compiled (on a GPU a width's first
        step takes many times its later ones), oneDNN primitives, a
        sparse view built. Until a cost is counted it is estimated, optimistically, so the
        pass is tried again."""
        if key in self._timed:
            return True
        self._timed.add(key)
        return False

    def drafting(self, counted: float) -> float:
        """What a proposal counted at ``counted`` target steps costs in measured plain steps:
        a count by weights misses per-pass overheads (small layers, a head's full-vocabulary
        softmax), so once both are timed the count is scaled by what proposals took."""
        plain = self.verify(1)
        if self.counted_step is None or not plain:
            return counted
        return counted * self.counted_step / plain

    def verify(self, width: int) -> float | None:
        """Seconds of a target pass ``width`` tokens wide: measured, interpolated between
        measured widths, or extrapolated from the nearest one: along the least-squares line
        through every measured width, or from the only one with a small prior slope
        (optimistic, so unmeasured widths get tried)."""
        if width in self.target:
            return self.target[width]
        if not self.target:
            return None
        if width not in self._estimates:
            self._estimates[width] = self._estimate(width)
        return self._estimates[width]

    def _estimate(self, width: int) -> float:
        """An unmeasured width's seconds (``verify``)."""
        below = [w for w in self.target if w < width]
        above = [w for w in self.target if w > width]
        if below and above:
            lo, hi = max(below), min(above)
            share = (width - lo) / (hi - lo)
            return self.target[lo] + share * (self.target[hi] - self.target[lo])
        nearest = max(below) if below else min(above)
        base = self.target[nearest]
        if len(self.target) == 1:  # one width measured: a prior slope
            prior = prior_cost(1 + abs(width - nearest), self.rows)
            return base * prior if width > nearest else base / prior
        # the slope of all measured widths: the two nearest alone, a token apart, made a wide
        # pass look dear whenever their noise ran uphill, and so it was never tried (a draft
        # head's sizes stuck small, run after run: lab/results/head_sizes.json). A wider pass
        # is no cheaper than the prior says, and a narrower one costs at least its share of
        # the tokens.
        line = base + _slope(self.target) * (width - nearest)
        if width > nearest:
            return max(line, base * prior_cost(1 + width - nearest, self.rows))
        return max(line, base * width / nearest)

    def best_gamma(self, alphas: Sequence[float], max_gamma: int) -> int | None:
        """The draft length with the highest expected rate for rows accepting with ``alphas``;
        0 where drafting loses to plain decoding; None while a cost is unmeasured."""
        if self.draft is None or not self.target:
            return None
        rates = {}
        for gamma in range(max_gamma + 1):
            verify = self.verify(gamma + 1)
            assert verify is not None  # some width is measured
            seconds = gamma * self.draft + verify
            rates[gamma] = sum(expected_tokens(gamma, a) for a in alphas) / seconds
        return max(rates, key=lambda g: (rates[g], -g))


@dataclass
class Acceptance:
    """What one request's model drafts earn, per token, per round and in all.

    Per token (``alpha``, MagicDec's cost model): each drafted position of a round is a trial
    until the first miss (``accepted`` successes, then one failure unless all passed). Per
    round (``mean``): the draft tokens kept, what a deeper pass must pay for. In all
    (``rounds``, ``kept``): whether a draft model on trial reads whole contexts.
    """

    successes: float = 1.0  # a uniform prior: alpha starts at 1/2
    failures: float = 1.0
    mean: float = 1.0  # an optimistic start: the first rounds draft deep
    rounds: int = 0
    kept: int = 0

    @property
    def alpha(self) -> float:
        return self.successes / (self.successes + self.failures)

    def record(self, drafted: int, accepted: int) -> None:
        """A round whose deepest path was ``drafted`` tokens kept ``accepted`` of them."""
        if drafted:
            self.successes = _SMOOTHING * self.successes + accepted
            self.failures = _SMOOTHING * self.failures + (accepted < drafted)
            self.mean = _SMOOTHING * self.mean + (1 - _SMOOTHING) * accepted
            self.rounds += 1
            self.kept += accepted


def settle(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so a timing covers it (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _slope(seconds: dict[int, float]) -> float:
    """The least-squares slope of seconds over width (at least 0: wider is never cheaper)."""
    mean_w = sum(seconds) / len(seconds)
    mean_t = sum(seconds.values()) / len(seconds)
    spread = sum((w - mean_w) ** 2 for w in seconds)
    return max(0.0, sum((w - mean_w) * (t - mean_t) for w, t in seconds.items()) / spread)


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else _SMOOTHING * previous + (1 - _SMOOTHING) * value
