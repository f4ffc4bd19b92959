"""A suffix array over a corpus's tokens (REST, SuffixDecoding): what followed, anywhere in the
knowledge base, the longest suffix of the context that occurs in it.

The trie drafter already copies from the prompt, its retrieved passages, the answer so far and
earlier answers; this index adds every other passage of the corpus, found in O(m log n) per
lookup without holding n-grams of the whole corpus in memory. A lookup finds the longest
suffix of the context (up to ``max_match`` tokens) that occurs, gathers what followed its
occurrences (at most ``max_occurrences``, spread evenly over the sorted range so their mix is
kept), and returns them as a continuation trie with counts: branches scored by frequency, and
as long as the match earned (twice its length, at most the drafter's branch length). A match
shorter than ``min_match`` drafts nothing: over a whole corpus, what followed one or two tokens
is mostly noise (measured on the embedded model's RAG answers over the default corpus: a
one-token match's most frequent path kept 0.13 tokens a position, three tokens' 0.34, four or
more 0.8-2.8; ``lab/corpus_drafts.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from pydivsufsort import divsufsort

from rag_spec.drafters.trie import Children
from rag_spec.progress import progress as bar

_SEPARATOR = -1  # ends every document: no match and no continuation crosses two documents


class SuffixIndex:
    """The documents' tokens, each followed by a separator, and their suffix array.

    Args:
        documents: token ids of each passage (and of whatever else drafts may copy from).
        max_match: the longest context suffix looked up.
        max_occurrences: the most occurrences a continuation trie is built from.
        min_match: the shortest match that drafts.

    Examples:
        >>> index = SuffixIndex([[1, 2, 3, 4], [9, 2, 3, 5]], min_match=2)
        >>> index.longest_match([7, 2, 3])
        (2, 2)
        >>> trie, length = index.continuations([7, 2, 3], depth=1)
        >>> sorted((token, count) for token, (count, _) in trie.items()), length
        ([(4, 1), (5, 1)], 2)
    """

    def __init__(self, documents: Iterable[Sequence[int]], *, max_match: int = 16,
                 max_occurrences: int = 64, min_match: int = 4) -> None:
        parts = [np.append(np.asarray(d, dtype=np.int32), np.int32(_SEPARATOR))
                 for d in documents if len(d)]
        self.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
        self.suffixes = divsufsort(self.tokens) if len(self.tokens) else \
            np.zeros(0, dtype=np.int32)
        self.max_match = max_match
        self.max_occurrences = max_occurrences
        self.min_match = min_match

    @classmethod
    def from_texts(cls, texts: Sequence[str], tokenizer: Any, *, progress: bool = False,
                   **kwargs: Any) -> SuffixIndex:
        """Tokenize ``texts`` (no special tokens) and index them (``progress``: a bar)."""
        batch = 256
        documents: list[list[int]] = []
        for start in bar(range(0, len(texts), batch), "suffix index", "batch",
                         enabled=progress):
            documents += tokenizer(list(texts[start:start + batch]),
                                   add_special_tokens=False)["input_ids"]
        return cls(documents, **kwargs)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return int(self.tokens.nbytes + self.suffixes.nbytes)

    def _range(self, pattern: list[int]) -> tuple[int, int]:
        """The suffixes that start with ``pattern``: ``suffixes[lo:hi]``."""
        m, text, sa = len(pattern), self.tokens, self.suffixes
        lo, hi = 0, len(sa)
        while lo < hi:  # first suffix >= pattern
            mid = (lo + hi) // 2
            start = int(sa[mid])
            if text[start:start + m].tolist() < pattern:
                lo = mid + 1
            else:
                hi = mid
        first, hi = lo, len(sa)
        while lo < hi:  # first suffix that does not start with pattern
            mid = (lo + hi) // 2
            start = int(sa[mid])
            if text[start:start + m].tolist() == pattern:
                lo = mid + 1
            else:
                hi = mid
        return first, lo

    def longest_match(self, context: Sequence[int]) -> tuple[int, int]:
        """(length, occurrences) of the longest suffix of ``context`` found (0 tokens: none)."""
        length, first, last = self._longest(context)
        return length, last - first

    def _longest(self, context: Sequence[int]) -> tuple[int, int, int]:
        """(length, first, last): the longest suffix of ``context`` found and its suffixes'
        range. A longer suffix occurs only where every shorter one does, so lengths are
        bisected."""
        found = first = last = 0
        lo, hi = 1, min(self.max_match, len(context))
        while lo <= hi:
            k = (lo + hi) // 2
            start, end = self._range([int(t) for t in context[-k:]])
            if end > start:
                found, first, last, lo = k, start, end, k + 1
            else:
                hi = k - 1
        return found, first, last

    def continuations(self, context: Sequence[int], depth: int
                      ) -> tuple[Children | None, int]:
        """What followed the longest suffix of ``context`` found, as a continuation trie of at
        most ``min(depth, 2 x its length)`` tokens, and that length (0: nothing found; no trie
        below ``min_match``)."""
        length, first, last = self._longest(context)
        if length < max(1, self.min_match):
            return None, length
        starts = self.suffixes[first:last]
        if len(starts) > self.max_occurrences:  # evenly over the range: sorted by what follows
            starts = starts[np.linspace(0, len(starts) - 1, self.max_occurrences).astype(int)]
        depth = min(depth, 2 * length)
        children: Children = {}
        for start in (int(s) + length for s in starts):
            level = children
            for token in self.tokens[start:start + depth].tolist():
                if token == _SEPARATOR:
                    break
                entry = level.get(token)
                if entry is None:
                    entry = level[token] = [0, {}]
                entry[0] += 1
                level = entry[1]
        return (children or None), length
