"""Documents become passages: ~100-word chunks, each titled by where it came from."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

PASSAGE_WORDS = 100
PASSAGE_CHARS = 2000  # bound for text with few spaces (tables, URLs, minified code)
MIN_WORDS = 8  # shorter documents ("Return self.") carry no retrievable content


@dataclass(frozen=True)
class Passage:
    """One retrievable unit of text."""

    title: str  # e.g. the dotted name "os.path.join", or a file path
    text: str


def chunk(title: str, text: str, words: int = PASSAGE_WORDS,
          chars: int = PASSAGE_CHARS) -> list[Passage]:
    """Split ``text`` into passages of at most ``words`` words and about ``chars`` characters
    (whitespace folded; a longer "word" is cut into pieces).

    Examples:
        >>> [p.text for p in chunk("t", "a b c d e f g h i j", words=4)]
        ['a b c d', 'e f g h', 'i j']
        >>> [p.text for p in chunk("t", "abcdefgh ij", chars=4)]
        ['abcd', 'efgh', 'ij']
    """
    tokens = [word[i:i + chars] for word in text.split() for i in range(0, len(word), chars)]
    passages: list[list[str]] = []
    size = 0
    for token in tokens:
        if not passages or len(passages[-1]) >= words or size + len(token) > chars:
            passages.append([])
            size = 0
        passages[-1].append(token)
        size += len(token) + 1
    return [Passage(title, " ".join(p)) for p in passages]


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
