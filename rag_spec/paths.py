"""Where rag-spec keeps its caches, and how it writes them so a crash never leaves half a file."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import platformdirs


def cache_dir() -> Path:
    """The cache root: ``$RAG_SPEC_CACHE`` if set, else the user cache directory."""
    root = os.environ.get("RAG_SPEC_CACHE") or platformdirs.user_cache_dir("rag-spec")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a scratch folder that replaces ``target`` only if the block succeeds.

    The scratch folder sits beside ``target`` so the final rename stays on one file system.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        yield scratch
        old = target.with_name(f".{target.name}.old")
        if target.exists():
            shutil.rmtree(old, ignore_errors=True)
            target.rename(old)
        scratch.rename(target)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


@contextlib.contextmanager
def atomic_file(target: Path) -> Iterator[Path]:
    """Yield a scratch path that replaces ``target`` only if the block succeeds."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    scratch = Path(name)
    try:
        yield scratch
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)
