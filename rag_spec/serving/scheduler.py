"""Continuous batching for ``LocalLM``: a request joins the batch in flight at its next step
and leaves it when it ends, each streaming its own text (vLLM's and SGLang's scheduling, over
the decoder's ``LiveBatch``).

Whoever waits on a request computes: the first waiter leads steps, for every row of the
batch, until its own requests end; the next waiter leads on, and the batch outlives its
leaders. Async callers wait on rag-spec's compute thread, so one thread computes
(``rag_spec.threads``). Greedy and sampled requests batch apart (their trees are planned
otherwise); a request of the other kind stops admission until the batch drains, so neither
kind starves. Tree sizes across rows are the decoder's ``StepPlanner``'s: one step's width is
what pays for the whole batch.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rag_spec.coalesce import Turns
from rag_spec.engine.batch import CANCELLED, DecodeStats, GenerationResult, LiveBatch, Row
from rag_spec.engine.decoder import LookaheadDecoder


@dataclass(eq=False)
class Job:
    """One prompt's request: its decoder options, where its settled text goes, its result."""

    prompt: list[int]
    options: dict[str, Any]  # ``LookaheadDecoder.new_rows`` keywords
    sink: Callable[[str], None] | None = None
    future: Future[GenerationResult] = field(default_factory=Future)
    row: Row | None = None
    cancelled: bool = False

    @property
    def greedy(self) -> bool:
        return not self.options.get("do_sample", False)

    @property
    def done(self) -> bool:
        return self.future.done()


class Scheduler:
    """Requests decoded by ``decoder`` in one batch that they join and leave step by step.

    Args:
        decoder: the decoder whose batch it keeps (held while rows are in flight).
        max_rows: most rows decoding at once; later requests wait for a row to end.
        wait_ms: how long a new batch waits for others to start with it (one prefill for
            requests that arrive together, e.g. a framework's ``batch``).
    """

    def __init__(self, decoder: LookaheadDecoder, *, max_rows: int = 8,
                 wait_ms: float = 5.0) -> None:
        self.decoder = decoder
        self.max_rows = max_rows
        self._wait = wait_ms / 1000
        self._pending: list[Job] = []
        self._running: dict[Row, Job] = {}
        self._batch: LiveBatch | None = None
        self._turns = Turns()  # a caller leads steps, or holds ``exclusive``
        self._changed = self._turns.changed
        self._held = 0  # ``exclusive`` callers waiting: nothing joins meanwhile, nobody steps

    def submit(self, prompt: list[int], options: dict[str, Any],
               sink: Callable[[str], None] | None = None) -> Job:
        """Queue a request without waiting; ``complete`` it later (on any thread). ``sink``
        gets its text as steps settle it."""
        job = Job(prompt, options, sink)
        with self._changed:
            self._pending.append(job)
            self._changed.notify_all()
        return job

    def cancel(self, job: Job) -> None:
        """Stop ``job`` (its caller went away): a queued one leaves the queue, a running one
        ends at the next step (``finish_reason`` "cancelled"); its row is freed then."""
        with self._changed:
            job.cancelled = True  # before reading ``row``: a job being admitted sees one
            if job in self._pending:
                self._pending.remove(job)
                job.future.set_result(GenerationResult([], "", CANCELLED, DecodeStats()))
            elif job.row is not None:
                job.row.cancel()
            self._changed.notify_all()

    def complete(self, jobs: Sequence[Job]) -> list[GenerationResult]:
        """Wait for ``jobs``, leading steps whenever nobody else does."""
        while not all(j.done for j in jobs):
            with self._turns.turn(lambda: all(j.done for j in jobs), self._may_step) as mine:
                while mine and not all(j.done for j in jobs) and self._step():
                    pass
        return [j.future.result() for j in jobs]

    def advance(self, satisfied: Callable[[], bool]) -> None:
        """For a stream's consumer: one step if nobody leads, else wait until
        ``satisfied()`` (its text came, or its end) or the lead is free."""
        with self._turns.turn(satisfied, self._may_step) as mine:
            if mine:
                self._step()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Hold the decoder for other work (an iterative RaLM loop): the rows in flight
        finish first, nothing joins until the block ends."""
        with self._changed:
            self._held += 1
        try:
            with self._turns.turn(lambda: False):
                while self._batch is not None:
                    self._step()
                yield
        finally:
            with self._changed:
                self._held -= 1
                self._changed.notify_all()

    def _may_step(self) -> bool:
        """An ``exclusive`` caller waiting goes first."""
        return not self._held

    def _step(self) -> bool:
        """Admit what may join, then one step of the batch (the leader's); False when there
        was nothing to do."""
        with self._changed:
            if self._batch is None and self._wait > 0 and len(self._pending) < self.max_rows:
                self._changed.wait_for(lambda: len(self._pending) >= self.max_rows,
                                       timeout=self._wait)
            admitted = self._admitted()
        if self._batch is None and not admitted:
            return False
        ended: list[Row] = []
        try:
            if self._batch is None:
                self._batch = self.decoder.open_batch(greedy=admitted[0].greedy)
            ended = self._batch.join(self._rows(admitted))
            if self._batch.live:
                ended += self._batch.step()
        except BaseException as error:  # every request of the batch gets it; the lead goes on
            self._fail(error)
            if not isinstance(error, Exception):
                raise
        finally:
            self._settle(ended)
        return True

    def _admitted(self) -> list[Job]:
        """Queued requests that join now (under the lock): in arrival order, of the batch's
        kind, while rows are free; none while ``exclusive`` waits or one of the other kind
        is first in line (the batch drains for it)."""
        if self._held or not self._pending:
            return []
        greedy = self._pending[0].greedy if self._batch is None else self._batch.greedy
        room = self.max_rows - (len(self._batch.live) if self._batch is not None else 0)
        taken: list[Job] = []
        for job in self._pending:
            if job.greedy != greedy or len(taken) == room:
                break
            taken.append(job)
        del self._pending[:len(taken)]
        return taken

    def _rows(self, jobs: Sequence[Job]) -> list[Row]:
        """A row for each job; a job whose options the decoder refuses gets the error."""
        rows = []
        for job in jobs:
            try:
                row = self.decoder.new_rows([job.prompt], **job.options, streamer=job.sink)[0]
            except Exception as error:  # this request's own fault: its caller gets it
                job.future.set_exception(error)
                continue
            job.row = row
            if job.cancelled:  # after setting ``row``: a cancel meanwhile sees one of them
                row.cancel()
            self._running[row] = job
            rows.append(row)
        return rows

    def _settle(self, ended: Sequence[Row]) -> None:
        """Hand out ended rows' results; close the batch once no row decodes."""
        for row in ended:
            job = self._running.pop(row, None)  # None: failed with its batch
            if job is not None:
                job.future.set_result(row.result())
        if self._batch is not None and not self._batch.live:
            self._batch.close()
            self._batch = None
            if not self._pending:
                _return_free_memory()
        with self._changed:
            self._changed.notify_all()

    def _fail(self, error: BaseException) -> None:
        for job in self._running.values():
            if not job.done:
                job.future.set_exception(error)
        self._running.clear()
        if self._batch is not None:
            batch, self._batch = self._batch, None
            batch.close()


def _return_free_memory() -> None:
    """Give the memory the batch's caches freed back to the system, once nothing decodes.
    Joins copy the batch into caches of new shapes; glibc keeps what they free in its heap,
    and a server's resident memory would otherwise sit at its busiest however idle it then
    is (``tests/test_server.py``'s soak)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim`` (None elsewhere: macOS, Windows, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    return getattr(ctypes.CDLL(None), "malloc_trim", None)
