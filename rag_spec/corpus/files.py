"""A folder of text files as a corpus: .txt, .md, .rst and .py, read recursively."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from rag_spec.errors import RagSpecError

SUFFIXES = (".txt", ".md", ".rst", ".py")


def folder_documents(folder: str | Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) for every readable text file below ``folder``."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        msg = f"{str(folder)!r} is not a folder. Pass a folder of {'/'.join(SUFFIXES)} files."
        raise RagSpecError(msg)
    for path in sorted(root.rglob("*")):
        if path.suffix.lower() in SUFFIXES and path.is_file():
            yield str(path.relative_to(root)), path.read_text(encoding="utf-8", errors="replace")
