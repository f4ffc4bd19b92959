"""Merge calls that arrive together from many threads into one batched call.

Frameworks run ``batch`` as concurrent ``invoke`` calls, and servers call a model from many
threads. A Coalescer turns those concurrent single calls back into real batches: the first
caller becomes the leader, waits ``wait_ms`` for others to join, runs the batch of requests
that share a key (e.g. the same sampling options) on its own thread, and hands the results
out; then the next waiting caller leads.

The work runs on a caller's thread, never on a private worker: with OpenMP (torch, faiss,
oneDNN) each thread that computes gets its own thread team, and two teams on the same cores
make every parallel region slower (measured here: a oneDNN matmul 4x, a decoding step 2x). A
single-threaded program keeps computing on its main thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Turns:
    """Whoever waits computes: one caller at a time leads (runs the shared work), the others
    wait until the lead is free or their own wait is over. ``changed`` is the lock and
    condition of whatever the callers share; notify it when that changes."""

    def __init__(self) -> None:
        self.changed = threading.Condition()
        self._busy = False

    @contextlib.contextmanager
    def turn(self, satisfied: Callable[[], bool], may_lead: Callable[[], bool] = lambda: True
             ) -> Iterator[bool]:
        """Wait until ``satisfied()`` (yields False) or the lead is free and ``may_lead()``
        (then lead: yields True, and the lead is freed when the block ends)."""
        with self.changed:
            self.changed.wait_for(lambda: satisfied() or not self._busy and may_lead())
            leading = not satisfied()
            self._busy = self._busy or leading
        try:
            yield leading
        finally:
            if leading:
                with self.changed:
                    self._busy = False
                    self.changed.notify_all()


@dataclass
class _Request(Generic[Item, Result]):
    key: Hashable
    item: Item
    future: Future[Result] = field(default_factory=Future)


class Coalescer(Generic[Item, Result]):
    """Runs ``run(key, items) -> results`` for batches of concurrent requests with equal keys.

    Args:
        run: handles a batch of items that share ``key``; returns one result per item.
        wait_ms: how long a leader waits for other requests to join its batch.
        max_batch: most items per batch.
    """

    def __init__(self, run: Callable[[Hashable, Sequence[Item]], Sequence[Result]], *,
                 wait_ms: float = 5.0, max_batch: int = 16) -> None:
        self._run = run
        self._wait = wait_ms / 1000
        self._max_batch = max_batch
        self._pending: list[_Request[Item, Result]] = []
        self._turns = Turns()
        self._changed = self._turns.changed

    def __call__(self, items: Sequence[Item], key: Hashable = None) -> list[Result]:
        """Results for ``items``, computed in batches with whatever else arrives meanwhile."""
        return self.complete(self.submit(items, key))

    def submit(self, items: Sequence[Item], key: Hashable = None) -> list[_Request[Item, Result]]:
        """Queue ``items`` without waiting; ``complete`` them later (on any thread)."""
        requests = [_Request[Item, Result](key, item) for item in items]
        with self._changed:
            self._pending.extend(requests)
            self._changed.notify_all()
        return requests

    def complete(self, requests: Sequence[_Request[Item, Result]]) -> list[Result]:
        """Wait for ``requests``, leading batches whenever nobody else does."""
        while not all(r.future.done() for r in requests):
            with self._turns.turn(lambda: all(r.future.done() for r in requests)) as mine:
                if mine:
                    self._lead(requests)
        return [r.future.result() for r in requests]

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the resource for other work (a stream, a RaLM loop) until the block ends."""
        with self._turns.turn(lambda: False):
            yield

    def _lead(self, mine: Sequence[_Request[Item, Result]]) -> None:
        """Run batches (others' too) until every one of ``mine`` has its result."""
        while not all(r.future.done() for r in mine):
            batch = self._next_batch(mine)
            try:
                results = self._run(batch[0].key, [r.item for r in batch])
            except BaseException as error:  # handed to every caller in the batch
                for request in batch:
                    request.future.set_exception(error)
            else:
                for request, result in zip(batch, results, strict=True):
                    request.future.set_result(result)
            with self._changed:
                self._changed.notify_all()

    def _next_batch(self, mine: Sequence[_Request[Item, Result]]
                    ) -> list[_Request[Item, Result]]:
        with self._changed:
            first = next(r for r in mine if not r.future.done())
            if self._wait > 0 and self._count(first.key) < self._max_batch:
                self._changed.wait_for(lambda: self._count(first.key) >= self._max_batch,
                                       timeout=self._wait)
            batch = [r for r in self._pending if r.key == first.key][:self._max_batch]
            if first not in batch:
                batch = [first, *batch[:self._max_batch - 1]]
            taken = {id(r) for r in batch}
            self._pending = [r for r in self._pending if id(r) not in taken]
            return batch

    def _count(self, key: Hashable) -> int:
        return sum(r.key == key for r in self._pending)
