"""Documents become passages: ~100-word chunks, each titled by where it came from."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

PASSAGE_WORDS = 100
MIN_WORDS = 8  # shorter documents ("Return self.") carry no retrievable content


@dataclass(frozen=True)
class Passage:
    """One retrievable unit of text."""

    title: str  # e.g. the dotted name "os.path.join", or a file path
    text: str


def chunk(title: str, text: str, words: int = PASSAGE_WORDS) -> list[Passage]:
    """Split ``text`` into passages of at most ``words`` words (whitespace folded).

    Examples:
        >>> [p.text for p in chunk("t", "a b c d e f g h i j", words=4)]
        ['a b c d', 'e f g h', 'i j']
    """
    tokens = text.split()
    return [Passage(title, " ".join(tokens[i:i + words])) for i in range(0, len(tokens), words)]


def passages_from(documents: Iterable[tuple[str, str]],
                  words: int = PASSAGE_WORDS) -> list[Passage]:
    """Chunk (title, text) documents, dropping ones too short to retrieve."""
    out: list[Passage] = []
    for title, text in documents:
        if len(text.split()) >= MIN_WORDS:
            out.extend(chunk(title, text, words))
    return out


def fingerprint(passages: Sequence[Passage]) -> str:
    """A content hash: an index built from other passages must never be used with these."""
    digest = hashlib.sha256()
    for p in passages:
        digest.update(json.dumps(asdict(p), ensure_ascii=False).encode())
    return digest.hexdigest()[:16]
