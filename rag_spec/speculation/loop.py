"""The guess -> verify in batches -> roll back loop, for any request that retrieves as it
decodes (``Speculation``).

A round decodes up to ``stride`` retrieval points on guessed retrievals, then verifies their
guesses with one call: in the foreground, or on a worker while the next round decodes on the
last guess (``StrideScheduler.overlaps``; up to ``max_in_flight`` rounds at once). At the first
wrong guess decoding rolls back to its point and goes on with the truth, and rounds in flight
behind it are dropped. A point without a guess ends its round: it is verified before decoding
goes on. The output is the naive loop's, token for token, whatever was guessed.
"""

from __future__ import annotations

import abc
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from rag_spec.retrieval.os3 import StrideScheduler

P = TypeVar("P")  # a retrieval point, with its guess
T = TypeVar("T")  # the truth a verification returns for a point


@dataclass
class SpeculationTally:
    """What a request's speculation did (both loops' stats carry these fields)."""

    speculation_hits: int = 0  # guessed points the verification confirmed
    rollbacks: int = 0
    strides: list[int] = field(default_factory=list)  # points verified per call
    waiting_seconds: float = 0.0  # blocked on a verification in flight


class Speculation(abc.ABC, Generic[P, T]):
    """One request's speculative retrieval: what the loop asks of it."""

    @abc.abstractmethod
    def advance(self) -> tuple[P | None, bool]:
        """Decode up to the next retrieval point and guess its retrieval; the point (None
        where decoding ended first) and whether decoding is done."""

    @abc.abstractmethod
    def guessed(self, point: P) -> bool:
        """Whether ``point`` has a guess to decode on."""

    @abc.abstractmethod
    def go_on(self, point: P, truth: T | None) -> None:
        """Decode on from ``point`` with its guess (``truth`` None) or with its truth."""

    @abc.abstractmethod
    def verify(self, points: Sequence[P], foreground: bool) -> tuple[list[T], float]:
        """One call for ``points``: their truths and the call's seconds (``foreground``: not
        on a worker beside decoding)."""

    @abc.abstractmethod
    def right(self, point: P, truth: T) -> bool:
        """Whether decoding on ``point``'s guess gave what its truth gives."""

    @abc.abstractmethod
    def roll_back(self, point: P, truth: T) -> None:
        """Undo decoding from ``point`` on and go on with its truth."""

    def confirmed(self, points: Sequence[P]) -> None:  # noqa: B027 (most keep nothing)
        """Every guess of ``points`` was right: what was kept to roll back to them may go."""


def speculate(spec: Speculation[P, T], scheduler: StrideScheduler, tally: SpeculationTally,
              *, max_in_flight: int = 1, initializer: Callable[[], Any] | None = None
              ) -> None:
    """Run ``spec`` to its end (module docstring); ``initializer`` prepares a verification
    worker's thread."""
    with ThreadPoolExecutor(max_workers=max_in_flight, thread_name_prefix="rag-spec-verify",
                            initializer=initializer) as pool:
        _rounds(spec, scheduler, tally, max_in_flight, pool)


def _rounds(spec: Speculation[P, T], scheduler: StrideScheduler, tally: SpeculationTally,
            max_in_flight: int, pool: ThreadPoolExecutor) -> None:
    pending: list[P] = []  # guessed points of the round being built
    in_flight: deque[tuple[Future, list[P]]] = deque()  # rounds under verification
    stride = scheduler.next_stride()
    while True:
        # 1. Decode to the next point on the last guess, and guess there.
        started = time.perf_counter()
        point, done = spec.advance()
        if point is not None:
            pending.append(point)
        scheduler.record_speculation(time.perf_counter() - started)
        settled = done or not spec.guessed(pending[-1])  # nothing left to speculate on
        if len(pending) < stride and not settled:
            spec.go_on(pending[-1], None)
            continue
        # 2. The round is complete: settle the oldest rounds in flight while the pipeline is
        # full (all of them once there is nothing left to speculate on).
        rolled_back = False
        while in_flight and (settled or _full(in_flight, scheduler, max_in_flight)):
            future, verified = in_flight.popleft()
            waited = time.perf_counter()
            truths, seconds = future.result()  # a retriever's error surfaces here
            tally.waiting_seconds += time.perf_counter() - waited
            rolled_back = _settle(spec, verified, truths, seconds, scheduler, tally)
            if rolled_back:
                in_flight.clear()  # younger rounds decoded past the wrong guess
                break
        if rolled_back:
            pending, stride = [], scheduler.next_stride()
            continue
        if not pending:
            return
        # 3. Verify this round: on a worker while the next round decodes, or now.
        tally.strides.append(len(pending))
        if scheduler.overlaps() and not settled:
            in_flight.append((pool.submit(spec.verify, list(pending), False), pending))
            spec.go_on(pending[-1], None)
            pending = []  # the next round decodes on the guess while it is checked
            continue
        truths, seconds = spec.verify(pending, True)
        if not _settle(spec, pending, truths, seconds, scheduler, tally):
            if done:
                return
            spec.go_on(pending[-1], truths[-1])
        pending, stride = [], scheduler.next_stride()


def _full(in_flight: deque[tuple[Future, list[P]]], scheduler: StrideScheduler,
          max_in_flight: int) -> bool:
    """Whether a new round must wait for the oldest in flight: the pipeline holds as many
    rounds as the scheduler lets run ahead of the guesses still unverified."""
    unverified = sum(len(points) for _, points in in_flight)
    return len(in_flight) >= scheduler.rounds_ahead(max_in_flight, unverified)


def _settle(spec: Speculation[P, T], points: list[P], truths: list[T], seconds: float,
            scheduler: StrideScheduler, tally: SpeculationTally) -> bool:
    """Check a round's guesses (verified by a call of ``seconds``); at the first wrong one roll
    back and go on with its truth. Returns whether it rolled back."""
    wrong = next((i for i, (p, t) in enumerate(zip(points, truths))
                  if spec.guessed(p) and not spec.right(p, t)), None)
    matched = len(points) if wrong is None else wrong
    tally.speculation_hits += sum(spec.guessed(p) for p in points[:matched])
    scheduler.record_verification(seconds, len(points), matched)
    if wrong is None:
        spec.confirmed(points)
        return False
    tally.rollbacks += 1
    spec.roll_back(points[wrong], truths[wrong])
    return True
