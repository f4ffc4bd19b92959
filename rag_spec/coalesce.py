"""Merge calls that arrive together from many threads or tasks into one batched call.

Frameworks run ``batch`` as concurrent ``invoke`` calls, and servers call a model from many
threads. A Coalescer turns those concurrent single calls back into real batches: one worker
thread owns the resource, gathers the requests that arrive within ``wait_ms`` of each other
(and share a key, e.g. the same sampling options), and runs them as one batch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class _Request(Generic[Item, Result]):
    key: Hashable
    item: Item
    future: Future[Result] = field(default_factory=Future)


class Coalescer(Generic[Item, Result]):
    """Runs ``run(key, items) -> results`` on one worker thread, batching concurrent requests.

    Args:
        run: handles a batch of items that share ``key``; returns one result per item.
        wait_ms: how long the worker waits after the first request for others to join it.
        max_batch: most items per batch.
        name: the worker thread's name.
    """

    def __init__(self, run: Callable[[Hashable, Sequence[Item]], Sequence[Result]], *,
                 wait_ms: float = 5.0, max_batch: int = 16, name: str = "rag-spec") -> None:
        self._run = run
        self._wait = wait_ms / 1000
        self._max_batch = max_batch
        self._name = name
        self._pending: list[_Request[Item, Result]] = []
        self._arrived = threading.Condition()
        self._worker: threading.Thread | None = None

    def submit(self, item: Item, key: Hashable = None) -> Future[Result]:
        """Queue ``item``; the future resolves to its result (or raises the batch's error)."""
        request: _Request[Item, Result] = _Request(key, item)
        with self._arrived:
            self._pending.append(request)
            if self._worker is None or not self._worker.is_alive():
                self._worker = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._worker.start()
            self._arrived.notify()
        return request.future

    def __call__(self, item: Item, key: Hashable = None) -> Result:
        """Submit and wait."""
        return self.submit(item, key).result()

    def _serve(self) -> None:
        while True:
            batch = self._next_batch()
            live = [r for r in batch if r.future.set_running_or_notify_cancel()]
            if not live:
                continue
            try:
                results = self._run(live[0].key, [r.item for r in live])
            except BaseException as error:  # noqa: BLE001  (handed to every caller)
                for request in live:
                    request.future.set_exception(error)
            else:
                for request, result in zip(live, results, strict=True):
                    request.future.set_result(result)

    def _next_batch(self) -> list[_Request[Item, Result]]:
        with self._arrived:
            while not self._pending:
                self._arrived.wait()
            first = self._pending[0]
            if self._max_batch > 1:
                self._arrived.wait_for(lambda: self._count(first.key) >= self._max_batch,
                                       timeout=self._wait)
            batch = [r for r in self._pending if r.key == first.key][:self._max_batch]
            taken = {id(r) for r in batch}
            self._pending = [r for r in self._pending if id(r) not in taken]
            return batch

    def _count(self, key: Any) -> int:
        return sum(r.key == key for r in self._pending)
