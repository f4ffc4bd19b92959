"""How many draft nodes to verify next step, from how many were being accepted."""

from __future__ import annotations


class AdaptiveBudget:
    """The full budget while drafts pay for themselves; none while they keep missing.

    A verified tree costs a little more than a one-token step (and a draft model's passes cost
    more still), so when the recent mean of accepted tokens falls below ``threshold`` the next
    steps draft nothing (a plain step's cost), except probe steps that measure whether drafts
    pay again: one in ``probe_every`` at first, half as often after each probe that missed too
    (down to one in ``max_probe_every``), as often as at first again once one hits.
    """

    def __init__(self, full: int, *, adaptive: bool = True, threshold: float = 0.2,
                 probe_every: int = 4, max_probe_every: int = 64, smoothing: float = 0.7,
                 initial: float = 1.0) -> None:
        self.full = full
        self.adaptive = adaptive
        self.threshold = threshold
        self.probe_every = probe_every
        self.max_probe_every = max_probe_every
        self.smoothing = smoothing
        self.mean_accepted = initial  # 1.0: an optimistic start, the first steps draft
        self._interval = probe_every  # steps between probes now
        self._idle = 0

    @property
    def current(self) -> int:
        if not self.adaptive or self.mean_accepted >= self.threshold:
            return self.full
        return self.full if self._idle >= self._interval - 1 else 0

    def update(self, drafted: int, accepted: int) -> None:
        """Record a step that verified ``drafted`` nodes and kept ``accepted`` of them."""
        if drafted == 0:
            self._idle += 1
            return
        probing = self.mean_accepted < self.threshold
        self._idle = 0
        self.mean_accepted = self.smoothing * self.mean_accepted + (1 - self.smoothing) * accepted
        if accepted:
            self._interval = self.probe_every
        elif probing:
            self._interval = min(2 * self._interval, self.max_probe_every)
