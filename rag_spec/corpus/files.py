"""A folder of text files as a corpus: .txt, .md, .rst and .py, read recursively.

Files that are not text (a NUL byte, bytes no text encoding reads, or mostly unprintable
characters) are skipped with a warning that counts them: indexing them would fill the
knowledge base with noise that retrieval then cites. Text in another encoding than UTF-8
(Latin-1, cp1252, ...) is read in the encoding charset-normalizer detects, and the log says
which.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import charset_normalizer

from rag_spec.errors import RagSpecError

SUFFIXES = (".txt", ".md", ".rst", ".py")
_MAX_UNPRINTABLE = 0.05  # share of characters that are neither printable nor whitespace

log = logging.getLogger(__name__)


def folder_documents(folder: str | Path) -> Iterator[tuple[str, str]]:
    """(relative path, text) for every text file below ``folder``."""
    root = Path(folder).expanduser()
    if not root.is_dir():
        msg = f"{str(folder)!r} is not a folder. Pass a folder of {'/'.join(SUFFIXES)} files."
        raise RagSpecError(msg)
    skipped: list[str] = []
    for path in sorted(root.rglob("*")):
        if path.suffix.lower() in SUFFIXES and path.is_file():
            text = read_text(path)
            if text is None:
                skipped.append(str(path.relative_to(root)))
            else:
                yield str(path.relative_to(root)), text
    if skipped:
        log.warning("rag-spec: skipped %d file(s) in %s that are not text in any encoding "
                    "(e.g. %s).", len(skipped), root, skipped[0])


def read_text(path: Path) -> str | None:
    """The file's text, or None when it is not a text file."""
    data = path.read_bytes()
    if b"\0" in data:
        return None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        found = _guessed(data)
        if found is None:
            return None
        log.info("rag-spec: %s is not UTF-8; read it as %s.", path, found.encoding)
        text = str(found)
    unprintable = sum(not (c.isprintable() or c.isspace()) for c in text)
    return None if unprintable > _MAX_UNPRINTABLE * max(len(text), 1) else text


def _guessed(data: bytes) -> Any:
    """charset-normalizer's best reading of ``data`` (None: no encoding reads it); among
    readings it rates alike (Western text reads the same in cp1250 and cp1252 to it), the
    commonest legacy encoding, Windows-1252 (Latin-1's superset)."""
    matches = list(charset_normalizer.from_bytes(data))
    if not matches:
        return None
    best = matches[0]
    alike = [m for m in matches if (m.chaos, m.coherence) == (best.chaos, best.coherence)]
    return next((m for m in alike if m.encoding in ("cp1252", "latin_1")), best)
