"""Lookahead's trie drafter: continuations seen in the prompt, the retrieved documents, the
output so far, and (decayed) earlier outputs, looked up by the last 1-3 committed tokens; with a
corpus's suffix index, also what followed the context's longest match anywhere in the corpus.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from rag_spec.drafters.drafter import (
    Capabilities,
    Drafter,
    DraftRequest,
    TargetView,
    propose_each,
)
from rag_spec.drafters.trie import BYTES_PER_NODE, Children, NGramTrie, best_nodes
from rag_spec.target.tree import TokenTree

if TYPE_CHECKING:
    from rag_spec.drafters.suffix_index import SuffixIndex

TrieMode = Literal["tree", "chains"]

# How much a continuation seen in this request counts against one remembered from earlier ones.
REQUEST_WEIGHT, MEMORY_WEIGHT = 4.0, 1.0
# What a corpus continuation that followed every occurrence of the match counts (a share of
# the occurrences, so a frequent match does not drown the request's own n-grams).
CORPUS_WEIGHT = 2.0
# A continuation only earlier answers hold (neither this request nor the corpus has it) holds
# far less often than its share says: another answer's next words, where this one's context
# matched a few tokens. Its share (and its subtree's) counts this much, which ranks it after
# the draft head's likely guesses in a merged tree: it fills the budget they leave (swept at
# a fixed 16 nodes: docs/concepts.md, "Why the defaults").
RECALLED_TRUST = 0.1


@dataclass(frozen=True)
class TrieConfig:
    """The trie drafter's settings (``LookaheadConfig`` carries them for the default drafter)."""

    branch_length: int = 8  # longest drafted continuation
    mode: TrieMode = "tree"  # "tree" (hierarchical) or "chains" (parallel branches)
    memory_mb: float = 64.0  # bound on the memory of earlier outputs


class TrieDrafter(Drafter):
    """Drafts from n-gram tries; the cross-request memory stays within ``memory_mb``.

    Args:
        branch_length: the longest drafted continuation (tree depth).
        mode: ``"tree"`` takes the most frequent nodes (shared prefixes, hierarchical);
            ``"chains"`` takes whole most-frequent branches side by side (parallel).
        memory_mb: bound on the output memory kept across requests.
        corpus: a suffix index over the knowledge base's passages (``SuffixIndex``): drafts
            also copy what followed the context anywhere in it.

    Examples:
        >>> texts = [p.text for p in kb.passages]                          # doctest: +SKIP
        >>> index = SuffixIndex.from_texts(texts, tokenizer)                # doctest: +SKIP
        >>> LookaheadDecoder(model, tokenizer, drafter=TrieDrafter(corpus=index))  # doctest: +SKIP
    """

    # its drafts are copied, not drawn from a distribution: sampled output does not depend on
    # them (sample-and-match), so a sampled batch sizes them as a greedy one does; a row's
    # state is its session, which finished rows drop
    capabilities = Capabilities(draws_drafts=False)

    def __init__(self, *, branch_length: int = 8, mode: TrieMode = "tree",
                 memory_mb: float = 64.0, max_key: int = 3,
                 corpus: SuffixIndex | None = None) -> None:
        self.branch_length = branch_length
        self.corpus = corpus
        self.mode = mode
        self.max_key = max_key
        max_nodes = int(memory_mb * 2**20 / BYTES_PER_NODE)
        self.memory = NGramTrie(branch_length=branch_length, max_key=max_key,
                                max_nodes=max_nodes)
        self._lock = threading.Lock()  # guards ``memory``: remembered into, read by proposals

    @property
    def label(self) -> str:  # type: ignore[override]
        return "trie" if self.corpus is None else "trie + corpus"

    @classmethod
    def from_config(cls, config: TrieConfig) -> TrieDrafter:
        return cls(branch_length=config.branch_length, mode=config.mode,
                   memory_mb=config.memory_mb)

    def propose(self, requests: Sequence[DraftRequest], target: TargetView | None
                ) -> list[TokenTree]:
        """Each row's tree from its own session (tries need nothing from the target)."""
        return propose_each(requests)

    def session(self, prompt: Sequence[int], extra_context: Sequence[Sequence[int]] = ()
                ) -> TrieSession:
        request = NGramTrie(branch_length=self.branch_length, max_key=self.max_key,
                            max_nodes=2**62)  # per request: bounded by the request's length
        for document in extra_context:
            request.insert(document)
        request.insert(prompt)
        return TrieSession(self, request)

    def remember(self, output: Sequence[int]) -> None:
        with self._lock:
            self.memory.insert(output)


class TrieSession:
    """One request's view: its own n-grams plus the shared memory."""

    def __init__(self, drafter: TrieDrafter, request: NGramTrie) -> None:
        self.drafter = drafter
        self.request = request

    def propose(self, context: Sequence[int], budget: int) -> TokenTree:
        if budget <= 0:
            return TokenTree.empty()
        corpus: list[tuple[Children, float]] = []
        if self.drafter.corpus is not None:  # read only: looked up outside the memory's lock
            found, _ = self.drafter.corpus.continuations(context, self.drafter.branch_length)
            if found:
                corpus.append((found, CORPUS_WEIGHT / sum(count for count, _ in found.values())))
        own = self.request.continuations(context)
        trusted = ([own] if own else []) + [found for found, _ in corpus]
        with self.drafter._lock:  # the shared memory must not change while it is walked
            recalled = self.drafter.memory.continuations(context)
            tries = ([(own, REQUEST_WEIGHT)] if own else []) \
                + ([(recalled, MEMORY_WEIGHT)] if recalled else []) + corpus
            if not tries:
                return TokenTree.empty()
            depth = self.drafter.branch_length
            if self.drafter.mode == "chains":
                return _chains(tries, budget, depth)
            tokens, parents, shares = best_nodes(tries, budget, depth)
        if recalled:  # reads only this request's trie and the corpus: outside the lock
            shares = _discounted(tokens, parents, shares, trusted)
        return TokenTree(tuple(tokens), tuple(parents), scores=tuple(shares))

    def observe(self, context: Sequence[int], new_from: int) -> None:
        """The n-grams the new tokens complete (answers often repeat themselves), read from
        the context's tail: whatever came before it (a RaLM segment's passages) was counted
        when it came in."""
        tail = max(0, new_from - self.request.branch_length - self.request.max_key + 1)
        self.request.insert(context[tail:], new_from - tail)

    def finish(self, output: Sequence[int]) -> None:
        self.drafter.remember(output)

    def add_documents(self, documents: Sequence[Sequence[int]]) -> None:
        for document in documents:
            self.request.insert(document)


def _discounted(tokens: list[int], parents: list[int], shares: list[float],
                trusted: list[Children]) -> list[float]:
    """``shares`` with each node that only the memory holds (its path in none of the
    ``trusted`` continuations: the request's, the corpus's), and its subtree, counted at
    ``RECALLED_TRUST``."""
    below: list[list[Children]] = []  # each node's continuations in the trusted tries
    factor: list[float] = []
    for token, parent in zip(tokens, parents):
        levels = trusted if parent < 0 else below[parent]
        below.append([level[token][1] for level in levels if token in level])
        above = 1.0 if parent < 0 else factor[parent]
        first_recalled = not below[-1] and (parent < 0 or bool(below[parent]))
        factor.append(above * (RECALLED_TRUST if first_recalled else 1.0))
    return [share * f for share, f in zip(shares, factor)]


def _chains(tries: list[tuple[Children, float]], budget: int, depth: int) -> TokenTree:
    """Parallel branches: from each of the most frequent first tokens, its most frequent chain."""
    firsts, _, _ = best_nodes(tries, budget, 1)
    paths = []
    used = 0
    for first in firsts:
        path = [first]
        level = [(c[first][1], w) for c, w in tries if first in c]
        while len(path) < depth and used + len(path) < budget:
            nxt, _, _ = best_nodes(level, 1, 1)
            if not nxt:
                break
            path.append(nxt[0])
            level = [(c[nxt[0]][1], w) for c, w in level if nxt[0] in c]
        paths.append(path)
        used += len(path)
        if used >= budget:
            break
    return TokenTree.from_paths(paths)
