"""Where heavy work runs, so that threads do not slow each other down.

torch, faiss and oneDNN parallelise with OpenMP, which gives every thread that computes its
own team of worker threads; once two teams exist on the same cores, every parallel region
runs slower, for as long as both threads live (measured on 2 cores: a decoding step took
nearly twice as long after one search on a live pool thread). Hence two rules:

- async entry points run their work on one shared compute thread (``run_in_compute_thread``),
  never on the event loop's default executor, whose several threads would each build a team;
- short work on helper threads (e.g. verifying retrievals while decoding continues) runs with
  one OpenMP thread (``use_one_openmp_thread``), which builds no team at all.

Retrieval mostly waits (a remote vector store, a service) and must never queue behind a
generation: async retrieval runs on its own small pool (``run_in_io_thread``), whose threads
use one OpenMP thread each.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")

_compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rag-spec-compute")
_io = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rag-spec-io",
                         initializer=lambda: use_one_openmp_thread())
# Calls that one batch makes side by side (a framework store searched query by query); its own
# pool, as those calls may come from the I/O pool's threads.
_side = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rag-spec-side",
                           initializer=lambda: use_one_openmp_thread())


async def run_in_compute_thread(fn: Callable[..., T], *args: Any) -> T:
    """Await ``fn(*args)`` run on rag-spec's compute thread (the event loop stays free)."""
    return await asyncio.get_running_loop().run_in_executor(
        _compute, functools.partial(fn, *args))


async def run_in_io_thread(fn: Callable[..., T], *args: Any) -> T:
    """Await ``fn(*args)`` run on rag-spec's I/O pool: work that mostly waits (retrieval),
    which a generation on the compute thread must not hold up."""
    return await asyncio.get_running_loop().run_in_executor(_io, functools.partial(fn, *args))


def start_io(fn: Callable[..., T], *args: Any) -> Future[T]:
    """Start ``fn(*args)`` on rag-spec's I/O pool, for a caller that computes while it waits."""
    return _io.submit(fn, *args)


def side_by_side(fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
    """``[fn(item) for item in items]``, the calls running at once: behind a remote store a
    batch of single searches then costs about one round trip."""
    return list(_side.map(fn, items))


def use_one_openmp_thread() -> None:
    """Make the calling thread's torch and faiss work single-threaded (other threads keep
    theirs: OpenMP thread counts are per thread)."""
    import torch

    torch.set_num_threads(1)
    try:
        import faiss
    except ImportError:
        return
    faiss.omp_set_num_threads(1)
