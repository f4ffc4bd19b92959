"""OS3, RaLMSpec's optimal speculation stride scheduler: pick how many retrievals to speculate
before one batched verification, from measured latencies and the recent hit rate.

a = latency of one speculation step (cache lookup + decoding one stride), b = latency of one
verification call, gamma = P(speculated passage == knowledge base's). With s speculation steps,
E[verified] = (1 - gamma^s) / (1 - gamma), and the expected latency of a round is
    synchronous:  s*a + b
    asynchronous: gamma^s * ((s-1)*a + max(a, b)) + (1 - gamma^s) * (s*a + b)
The stride maximises E[verified] / latency.
"""

from __future__ import annotations

from collections import deque


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


def best_stride(a: float, b: float, gamma: float, asynchronous: bool, max_stride: int) -> int:
    """The ``s`` in 1..max_stride maximising verified speculations per second."""
    def rate(s: int) -> float:
        return expected_verified(s, gamma) / max(round_latency(s, a, b, gamma, asynchronous),
                                                  1e-9)
    return max(range(1, max_stride + 1), key=rate)


class StrideScheduler:
    """Fixed stride, or OS3 over a sliding window of the last ``window`` verifications."""

    def __init__(self, *, os3: bool = True, fixed: int = 3, asynchronous: bool = False,
                 max_stride: int = 8, window: int = 5, gamma_max: float = 0.6) -> None:
        self.os3 = os3
        self.fixed = fixed
        self.asynchronous = asynchronous
        self.max_stride = max_stride
        self.gamma_max = gamma_max
        self._rounds: deque[tuple[int, int]] = deque(maxlen=window)  # (speculated, matched)
        self._a: deque[float] = deque(maxlen=window)
        self._b: deque[float] = deque(maxlen=window)
        self._g: deque[float] = deque(maxlen=window)  # cache guesses (embedding the query...)
        self.cpu_bound = False  # verification keeps this machine's cores busy (not a remote wait)

    def record_speculation(self, seconds: float) -> None:
        self._a.append(seconds)

    def record_cpu_share(self, cpu_seconds: float, wall_seconds: float) -> None:
        """A synchronous verification used ``cpu_seconds`` of process CPU in ``wall_seconds``."""
        self.cpu_bound = cpu_seconds > 0.5 * wall_seconds

    def overlaps(self) -> bool:
        """Verify asynchronously only when verification waits rather than computes: on a small
        machine a CPU-bound search on a worker thread slows decoding more than it hides."""
        return self.asynchronous and not self.cpu_bound

    def record_guess(self, seconds: float) -> None:
        self._g.append(seconds)

    def worth_guessing(self) -> bool:
        """Guess only while a guess costs less than asking the knowledge base outright."""
        if not self._g or not self._b:
            return True
        return sum(self._g) / len(self._g) < min(self._b)

    def record_verification(self, seconds: float, speculated: int, matched: int) -> None:
        self._b.append(seconds)
        self._rounds.append((speculated, matched))

    @property
    def gamma(self) -> float:
        """RaLMSpec's estimate: matches over matches plus rounds that ended in a mismatch."""
        matched = sum(m for _, m in self._rounds)
        missed = sum(1 for s, m in self._rounds if m < s)
        if matched + missed == 0:
            return 0.0
        return min(self.gamma_max, matched / (matched + missed))

    def next_stride(self) -> int:
        if not self.os3:
            return self.fixed
        if not self._a or not self._b:
            return 1  # cold start, as RaLMSpec's --adapt_cold_start 1
        a = sum(self._a) / len(self._a)
        b = self._b[-1]
        return best_stride(a, b, self.gamma, self.overlaps(), self.max_stride)
