"""Where rag-spec keeps its caches, and how it writes them so a crash never leaves half a file."""

from __future__ import annotations

import contextlib
import glob
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """The cache root: ``$RAG_SPEC_CACHE`` if set, else the user cache directory."""
    # imported here: the decoder runs on machines with only torch and transformers (make
    # gpu-check), where nothing is cached
    import platformdirs

    root = os.environ.get("RAG_SPEC_CACHE") or platformdirs.user_cache_dir("rag-spec")
    path = Path(root).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_dir(target: Path) -> Iterator[Path]:
    """Yield a scratch folder that replaces ``target`` only if the block succeeds.

    The scratch folder sits beside ``target`` so the final rename stays on one file system;
    scratch left by a writer that was killed is removed here.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_scratch(target)
    scratch = Path(tempfile.mkdtemp(prefix=_scratch_prefix(target), dir=target.parent))
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
    remove_stale_scratch(target)
    fd, name = tempfile.mkstemp(prefix=_scratch_prefix(target), dir=target.parent)
    os.close(fd)
    scratch = Path(name)
    try:
        yield scratch
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)


def _scratch_prefix(target: Path) -> str:
    """Scratch names carry the writer's process id, so a later writer can tell abandoned
    scratch (its process is gone) from a concurrent writer's."""
    return f".{target.name}.{os.getpid()}."


def remove_stale_scratch(target: Path) -> None:
    """Delete scratch files and folders of ``target`` whose writing process no longer runs."""
    for path in target.parent.glob(f".{glob.escape(target.name)}.*"):
        pid = path.name[len(target.name) + 2:].split(".", 1)[0]
        if pid.isdigit() and not _running(int(pid)):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
