"""An n-gram trie of token continuations (Lookahead's drafting memory), as pure data structures.

``roots[key]`` is the node whose continuations were seen after the token tuple ``key`` (1 to
``max_key`` tokens long); a node's children map a token to the node after it, each with how
often it followed. Counts along a path never increase with depth, so picking the most frequent
nodes first always yields a prefix-closed tree.

Nodes are numbers into two flat lists (children, counts), not an object each: a node's children
are a dict of ints, which Python's garbage collector does not track. A trie of nested lists
(two tracked objects a node, thousands a RAG prompt, up to ~400k in the memory of earlier
answers) made every few requests pay a full collection that walked them all
(docs/concepts.md, "Why the defaults").
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

# token -> (count, what followed it): a trie level as ``best_nodes`` reads it (``Level`` here;
# the suffix index builds plain dicts of ``[count, children]`` lists)
Children = Mapping[int, Any]

BYTES_PER_NODE = 330  # measured: a node's share of the lists and dicts (tests pin this down)


class NGramTrie:
    """Continuations of up to ``branch_length`` tokens, keyed by the 1..``max_key`` tokens before.

    The node count is bounded: past ``max_nodes`` every count is halved and nodes that fall to
    zero are dropped, so old, rare n-grams fade while frequent ones stay.
    """

    def __init__(self, *, branch_length: int = 8, max_key: int = 3,
                 max_nodes: int = 200_000) -> None:
        self.branch_length = branch_length
        self.max_key = max_key
        self.max_nodes = max_nodes
        self.roots: dict[tuple[int, ...], int] = {}  # key -> the node its continuations hang from
        self.nodes = 0  # continuation nodes (the keys' own nodes not counted)
        self._children: list[dict[int, int] | None] = []  # node -> {token: node}; None: a leaf
        self._counts: list[int] = []  # node -> how often its token followed its parent

    def insert(self, tokens: Sequence[int], new_from: int = 0) -> None:
        """Count the n-grams of ``tokens`` that involve a token at index ``new_from`` or later.

        Calling ``insert(seq, 0)`` then ``insert(seq + more, len(seq))`` counts every n-gram
        of ``seq + more`` exactly once, so a stream can be inserted as it grows.
        """
        tokens = list(tokens)
        first = max(1, new_from - self.branch_length + 1)
        for start in range(first, len(tokens)):
            branch = tokens[start:start + self.branch_length]
            skip = max(0, new_from - start)  # prefix already counted by an earlier call
            for q in range(1, min(self.max_key, start) + 1):
                self._add(tuple(tokens[start - q:start]), branch, skip)
        if self.nodes > self.max_nodes:
            self.decay()

    def _add(self, key: tuple[int, ...], branch: Sequence[int], skip: int) -> None:
        node = self.roots.get(key)
        if node is None:
            node = self.roots[key] = self._node(0)
        children, counts = self._children, self._counts
        for depth, token in enumerate(branch):
            below = children[node]
            if below is None:
                below = children[node] = {}
            child = below.get(token)
            if child is None:
                child = below[token] = self._node(0)
                self.nodes += 1
            if depth >= skip:
                counts[child] += 1
            node = child

    def _node(self, count: int) -> int:
        self._children.append(None)
        self._counts.append(count)
        return len(self._counts) - 1

    def decay(self) -> None:
        """Halve every count, dropping nodes that reach zero, until under ``max_nodes``."""
        while self.nodes > self.max_nodes:
            children, counts = self._children, self._counts
            self._children, self._counts, self.nodes = [], [], 0
            roots = {}
            for key, node in self.roots.items():
                if any(counts[child] // 2 for child in (children[node] or {}).values()):
                    roots[key] = self._halved(children, counts, node)
            self.roots = roots

    def _halved(self, children: list[dict[int, int] | None], counts: list[int], node: int
                ) -> int:
        """A copy of ``node``'s subtree from the lists before a decay, counts halved, nodes
        that fall to zero dropped with what hangs below them (no count below exceeds
        theirs)."""
        copy = self._node(counts[node] // 2)
        for token, child in (children[node] or {}).items():
            if counts[child] // 2:
                below = self._children[copy]
                if below is None:
                    below = self._children[copy] = {}
                below[token] = self._halved(children, counts, child)
                self.nodes += 1
        return copy

    def following(self, key: tuple[int, ...]) -> Level | None:
        """What followed ``key`` (None: it was never seen)."""
        node = self.roots.get(key)
        return None if node is None else Level(self, node)

    def continuations(self, context: Sequence[int]) -> Level | None:
        """The continuation trie of the longest key that ends ``context`` and was seen."""
        for q in range(min(self.max_key, len(context)), 0, -1):
            found = self.following(tuple(context[-q:]))
            if found:
                return found
        return None


class Level(Mapping[int, tuple[int, "Level"]]):
    """A node's children as ``best_nodes`` reads them: token -> (count, the child's children).
    A view over the trie's lists, made as it is read."""

    __slots__ = ("_node", "_trie")

    def __init__(self, trie: NGramTrie, node: int) -> None:
        self._trie, self._node = trie, node

    def _below(self) -> dict[int, int]:
        return self._trie._children[self._node] or {}

    def __getitem__(self, token: int) -> tuple[int, Level]:
        child = self._below()[token]
        return self._trie._counts[child], Level(self._trie, child)

    def __iter__(self) -> Iterator[int]:
        return iter(self._below())

    def __len__(self) -> int:
        return len(self._below())

    def __contains__(self, token: object) -> bool:
        return token in self._below()

    def items(self) -> Iterator[tuple[int, tuple[int, Level]]]:  # type: ignore[override]
        trie, counts = self._trie, self._trie._counts
        return ((token, (counts[child], Level(trie, child)))
                for token, child in self._below().items())


def best_nodes(tries: Sequence[tuple[Children, float]], budget: int, max_depth: int
               ) -> tuple[list[int], list[int], list[float]]:
    """The ``budget`` most frequent nodes of several weighted tries merged, as (tokens, parents,
    shares): a node's share is the product, along its path, of each token's weighted count over
    its siblings' (how often, where its parent was seen, the token followed).

    Parents precede children (a child enters the frontier only once its parent is taken), which
    is the layout TokenTree wants.
    """
    tokens: list[int] = []
    parents: list[int] = []
    shares: list[float] = []
    frontier: list[tuple[float, int, int, int, float, list[tuple[Children, float]]]] = []
    serial = 0  # tie-breaker: earlier-pushed first, and never compares the tries

    def push(parent: int, level: Sequence[tuple[Children, float]], share: float) -> None:
        nonlocal serial
        merged: dict[int, tuple[float, list[tuple[Children, float]]]] = {}
        for children, weight in level:
            for token, (count, below) in children.items():
                score, subs = merged.get(token, (0.0, []))
                merged[token] = (score + weight * count, [*subs, (below, weight)])
        total = sum(score for score, _ in merged.values())
        for token, (score, subs) in merged.items():
            heapq.heappush(frontier, (-score, serial, token, parent, share * score / total, subs))
            serial += 1

    depth_of: list[int] = []
    push(-1, tries, 1.0)
    while frontier and len(tokens) < budget:
        _, _, token, parent, share, subs = heapq.heappop(frontier)
        node = len(tokens)
        tokens.append(token)
        parents.append(parent)
        shares.append(share)
        depth = 1 if parent < 0 else depth_of[parent] + 1
        depth_of.append(depth)
        if depth < max_depth:
            push(node, subs, share)
    return tokens, parents, shares
