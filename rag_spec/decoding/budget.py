"""How many draft nodes to verify next step, from how many were being accepted."""

from __future__ import annotations


class AdaptiveBudget:
    """Full budget while drafts pay; a small probe budget while they keep missing.

    A multi-token step costs more than a one-token step, so when nothing matches for a while the
    budget drops to ``probe`` nodes (cheap enough to cost about a plain step), and it returns to
    full as soon as a probe is accepted.
    """

    def __init__(self, full: int, *, adaptive: bool = True, probe: int = 2,
                 smoothing: float = 0.5) -> None:
        self.full = full
        self.probe = min(probe, full)
        self.adaptive = adaptive
        self.smoothing = smoothing
        self.mean_accepted = 1.0  # optimistic start: the first steps try the full budget

    @property
    def current(self) -> int:
        if not self.adaptive or self.mean_accepted >= 0.5:
            return self.full
        return self.probe

    def update(self, accepted: int) -> None:
        self.mean_accepted = self.smoothing * self.mean_accepted + (1 - self.smoothing) * accepted
