"""OS3, RaLMSpec's optimal speculation stride scheduler: pick how many retrievals to speculate
before one batched verification, from measured latencies and the recent hit rate.

a = latency of one speculation step (cache lookup + decoding one stride), b = latency of one
verification call, gamma = P(speculated passage == knowledge base's). With s speculation steps,
E[verified] = (1 - gamma^s) / (1 - gamma), and the expected latency of a round is
    synchronous:  s*a + b
    asynchronous: gamma^s * ((s-1)*a + max(a, b)) + (1 - gamma^s) * (s*a + b)
The stride maximises E[verified] / latency. The paper takes b as fixed (a GPU scores a batch of
queries in the time of one); on a CPU a batched exact search costs more per query, so b is
fitted over recent calls as b(s) = b(1) + (s - 1) * b_per_query, and b_per_query is 0 when the
calls do not tell it (one batch size seen, or a remote store whose delay does not grow).
"""

from __future__ import annotations

from collections import deque

import numpy as np


def round_latency(s: int, a: float, b: float, gamma: float, asynchronous: bool) -> float:
    """Expected latency of a round of ``s`` speculation steps and one verification."""
    if not asynchronous:
        return s * a + b
    hit_all = gamma**s
    return hit_all * ((s - 1) * a + max(a, b)) + (1 - hit_all) * (s * a + b)


def expected_verified(s: int, gamma: float) -> float:
    """Expected number of speculations confirmed in a round of ``s``."""
    if gamma >= 1.0:
        return float(s)
    return (1 - gamma**s) / (1 - gamma)


def best_stride(a: float, b: float, gamma: float, asynchronous: bool, max_stride: int,
                b_per_query: float = 0.0) -> int:
    """The ``s`` in 1..max_stride maximising verified speculations per second, where a call
    with ``s`` queries takes ``b + (s - 1) * b_per_query``."""
    def rate(s: int) -> float:
        latency = round_latency(s, a, b + (s - 1) * b_per_query, gamma, asynchronous)
        return expected_verified(s, gamma) / max(latency, 1e-9)
    return max(range(1, max_stride + 1), key=rate)


def fit_verification(calls: list[tuple[int, float]]) -> tuple[float, float]:
    """(latency of a one-query call, latency per extra query) from (queries, seconds) pairs,
    by least squares; the newest latency and no growth while only one batch size was seen."""
    sizes = np.array([n for n, _ in calls], dtype=float)
    seconds = np.array([t for _, t in calls], dtype=float)
    if np.ptp(sizes) == 0:
        return float(seconds[-1]), 0.0
    slope = max(0.0, float(np.polyfit(sizes, seconds, 1)[0]))
    one = float(np.mean(seconds) - slope * (np.mean(sizes) - 1))
    return max(one, 1e-6), slope


class StrideScheduler:
    """Fixed stride, or OS3 over a sliding window of the last ``window`` verifications."""

    def __init__(self, *, os3: bool = True, fixed: int = 3, asynchronous: bool = False,
                 max_stride: int = 8, window: int = 5) -> None:
        self.os3 = os3
        self.fixed = fixed
        self.asynchronous = asynchronous
        self.max_stride = max_stride
        self._rounds: deque[tuple[int, int]] = deque(maxlen=window)  # (speculated, matched)
        self._a: deque[float] = deque(maxlen=window)
        self._calls: deque[tuple[int, float]] = deque(maxlen=window)  # (queries, seconds)
        self._g: deque[float] = deque(maxlen=window)  # cache guesses (embedding the query...)
        self.cpu_bound = False  # verification keeps this machine's cores busy (not a remote wait)

    def resume(self, previous: StrideScheduler) -> None:
        """Start from the measurements of ``previous`` (an earlier request of the same loop)."""
        for mine, theirs in ((self._rounds, previous._rounds), (self._a, previous._a),
                             (self._calls, previous._calls), (self._g, previous._g)):
            mine.extend(theirs)
        self.cpu_bound = previous.cpu_bound

    def record_speculation(self, seconds: float) -> None:
        self._a.append(seconds)

    def record_cpu_share(self, cpu_seconds: float, wall_seconds: float) -> None:
        """A synchronous verification used ``cpu_seconds`` of process CPU in ``wall_seconds``."""
        self.cpu_bound = cpu_seconds > 0.5 * wall_seconds

    def overlaps(self) -> bool:
        """Verify asynchronously only when verification waits rather than computes: on a small
        machine a CPU-bound search on a worker thread slows decoding more than it hides."""
        return self.asynchronous and not self.cpu_bound

    def rounds_ahead(self, most: int, unverified: int) -> int:
        """Rounds that may be under verification at once: ``most`` while the ``unverified``
        guesses still in flight are likelier all right than not, else 1. A round decoded past
        a wrong guess is thrown away with its call; with guesses that mostly miss (a scorer
        that disagrees with the store's ranking), rounds run ahead only add calls."""
        return most if self.gamma ** unverified >= 0.5 else 1

    def record_guess(self, seconds: float) -> None:
        self._g.append(seconds)

    def worth_guessing(self) -> bool:
        """Guess only while a guess costs less than asking the knowledge base outright."""
        if not self._g or not self._calls:
            return True
        return sum(self._g) / len(self._g) < min(t for _, t in self._calls)

    def record_verification(self, seconds: float, speculated: int, matched: int) -> None:
        """A call that verified ``speculated`` queries in ``seconds``, ``matched`` of them right."""
        self._calls.append((speculated, seconds))
        self._rounds.append((speculated, matched))

    @property
    def gamma(self) -> float:
        """RaLMSpec's counts (guesses matched; rounds that ended in a mismatch) under a uniform
        prior: 0.5 before any evidence, near 1 only after many matches. The paper capped its
        plain ratio at 0.6 instead, since the ratio says 1.0 after one lucky round; that cap
        kept strides short even when prefetching made every guess right."""
        matched = sum(m for _, m in self._rounds)
        missed = sum(1 for s, m in self._rounds if m < s)
        return (matched + 1) / (matched + missed + 2)

    def next_stride(self) -> int:
        if not self.os3:
            return self.fixed
        if not self._a or not self._calls:
            return 1  # cold start, as RaLMSpec's --adapt_cold_start 1
        a = sum(self._a) / len(self._a)
        b, b_per_query = fit_verification(list(self._calls))
        return best_stride(a, b, self.gamma, self.overlaps(), self.max_stride, b_per_query)
