"""An n-gram trie of token continuations (Lookahead's drafting memory), as pure data structures.

``roots[key]`` is a trie of the continuations seen after the token tuple ``key`` (1 to
``max_key`` tokens long). A trie node maps a token to ``[count, children]``; counts along a
path never increase with depth, so picking the most frequent nodes first always yields a
prefix-closed tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

Children = dict[int, list]  # token -> [count, Children]

BYTES_PER_NODE = 330  # measured: one dict entry plus its [count, {}] list (tests pin this down)


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
        self.roots: dict[tuple[int, ...], Children] = {}
        self.nodes = 0

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
        children = self.roots.setdefault(key, {})
        for depth, token in enumerate(branch):
            entry = children.get(token)
            if entry is None:
                entry = children[token] = [0, {}]
                self.nodes += 1
            if depth >= skip:
                entry[0] += 1
            children = entry[1]

    def decay(self) -> None:
        """Halve every count, dropping nodes that reach zero, until under ``max_nodes``."""
        while self.nodes > self.max_nodes:
            self.nodes = 0
            for key in list(self.roots):
                self.nodes += _halve(self.roots[key])
                if not self.roots[key]:
                    del self.roots[key]

    def continuations(self, context: Sequence[int]) -> Children | None:
        """The continuation trie of the longest key that ends ``context`` and was seen."""
        for q in range(min(self.max_key, len(context)), 0, -1):
            found = self.roots.get(tuple(context[-q:]))
            if found:
                return found
        return None


def _halve(children: Children) -> int:
    """Halve counts below ``children`` in place; returns how many nodes survive."""
    kept = 0
    for token in list(children):
        entry = children[token]
        entry[0] //= 2
        if entry[0] == 0:
            del children[token]
        else:
            kept += 1 + _halve(entry[1])
    return kept


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
