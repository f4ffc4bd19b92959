"""The guess -> verify in batches -> roll back loop, for any request that retrieves as it
decodes (``Speculation``).

A round decodes up to ``stride`` retrieval points on guessed retrievals, then verifies their
guesses with one call: in the foreground, or on a worker while the next round decodes on the
last guess (``StrideScheduler.overlaps``; up to ``max_in_flight`` rounds at once). At the first
wrong guess decoding rolls back to its point and goes on with the truth, and rounds in flight
behind it are dropped. A point without a guess ends its round: it is verified before decoding
goes on. The output is the naive loop's, token for token, whatever was guessed.

A verification that finds a wrong guess while decoding runs ahead of it cancels that decoding
(``Cancel``): everything decoded past the wrong guess is dropped anyway, so a stride that can
stop early (a served model's stream, ``Speculation.cancellable``) stops there.
"""

from __future__ import annotations

import abc
import contextlib
import functools
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
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


class Cancel:
    """Set once decoding in progress is known to be wasted (a round in flight holds a wrong
    guess). Decoding that waits on something it can abandon (a served stride's stream) hooks
    its abandonment here; ``set`` runs the hooks, from whichever thread found the wrong guess.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False
        self._hooks: list[Callable[[], None]] = []

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        with self._lock:
            if self._set:
                return
            self._set = True
            hooks = list(self._hooks)
        for hook in hooks:
            hook()

    @contextlib.contextmanager
    def hooked(self, abandon: Callable[[], None]) -> Iterator[None]:
        """Run ``abandon`` if this is set while the block runs (at once if it already is)."""
        with self._lock:
            already = self._set
            if not already:
                self._hooks.append(abandon)
        if already:
            abandon()
        try:
            yield
        finally:
            with self._lock:
                if abandon in self._hooks:
                    self._hooks.remove(abandon)


class Speculation(abc.ABC, Generic[P, T]):
    """One request's speculative retrieval: what the loop asks of it."""

    # whether ``advance`` can stop early on its ``cancel`` (then the loop checks each round in
    # flight as soon as its verification returns, to set it)
    cancellable: bool = False

    @abc.abstractmethod
    def advance(self, cancel: Cancel) -> tuple[P | None, bool]:
        """Decode up to the next retrieval point and guess its retrieval; the point (None
        where decoding ended first, or stopped on ``cancel``) and whether decoding is done."""

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
    cancel = Cancel()  # set when a round in flight is found wrong; a new one after each rollback
    stride = scheduler.next_stride()
    while True:
        # 1. Decode to the next point on the last guess, and guess there.
        started = time.perf_counter()
        point, done = spec.advance(cancel)
        if cancel.is_set():  # a round in flight is wrong: roll back to it, dropping this stride
            rolled_back = _settle_in_flight(spec, in_flight, scheduler, tally, max_in_flight,
                                            everything=True)
            assert rolled_back, "a cancelled stride rolls back to the wrong guess"
            pending, stride, cancel = [], scheduler.next_stride(), Cancel()
            continue
        if point is not None:
            pending.append(point)
        scheduler.record_speculation(time.perf_counter() - started)
        settled = done or not spec.guessed(pending[-1])  # nothing left to speculate on
        if len(pending) < stride and not settled:
            spec.go_on(pending[-1], None)
            continue
        # 2. The round is complete: settle the oldest rounds in flight while the pipeline is
        # full (all of them once there is nothing left to speculate on).
        if _settle_in_flight(spec, in_flight, scheduler, tally, max_in_flight,
                             everything=settled):
            pending, stride, cancel = [], scheduler.next_stride(), Cancel()
            continue
        if not pending:
            return
        # 3. Verify this round: on a worker while the next round decodes, or now.
        tally.strides.append(len(pending))
        if scheduler.overlaps() and not settled:
            future = pool.submit(spec.verify, list(pending), False)
            if spec.cancellable:
                future.add_done_callback(functools.partial(_cancel_if_wrong, spec, pending,
                                                           cancel))
            in_flight.append((future, pending))
            spec.go_on(pending[-1], None)
            pending = []  # the next round decodes on the guess while it is checked
            continue
        truths, seconds = spec.verify(pending, True)
        if not _settle(spec, pending, truths, seconds, scheduler, tally):
            if done:
                return
            spec.go_on(pending[-1], truths[-1])
        pending, stride = [], scheduler.next_stride()


def _settle_in_flight(spec: Speculation[P, T], in_flight: deque[tuple[Future, list[P]]],
                      scheduler: StrideScheduler, tally: SpeculationTally, max_in_flight: int,
                      *, everything: bool) -> bool:
    """Settle the oldest rounds in flight while the pipeline is full (``everything``: all of
    them); at a rollback the younger ones are dropped (they decoded past the wrong guess).
    Returns whether it rolled back."""
    while in_flight and (everything or _full(in_flight, scheduler, max_in_flight)):
        future, verified = in_flight.popleft()
        waited = time.perf_counter()
        truths, seconds = future.result()  # a retriever's error surfaces here
        tally.waiting_seconds += time.perf_counter() - waited
        if _settle(spec, verified, truths, seconds, scheduler, tally):
            in_flight.clear()
            return True
    return False


def _cancel_if_wrong(spec: Speculation[P, T], points: list[P], cancel: Cancel,
                     future: Future) -> None:
    """On the verifying worker, as its call returns: cancel the decoding running ahead if a
    guess of ``points`` was wrong (settling still happens in order, on the loop's thread)."""
    if future.cancelled() or future.exception() is not None:
        return  # the error surfaces where the round is settled
    truths, _ = future.result()
    if any(spec.guessed(p) and not spec.right(p, t) for p, t in zip(points, truths)):
        cancel.set()


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
