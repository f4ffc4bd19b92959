"""The draft every drafter proposes and the verifier checks: a tree of tokens.

The root is implicit: it is the last committed token, whose next-token logits come from the same
forward pass. Node ``i`` holds ``tokens[i]`` and hangs below ``parents[i]`` (-1 = the root);
parents always come before their children, so a tree is a prefix-closed list of paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch


@dataclass(frozen=True)
class TokenTree:
    """Draft tokens plus each one's parent index; depths and the ancestor mask derive from them.

    Examples:
        >>> tree = TokenTree.from_paths([[5, 6], [5, 7], [8]])
        >>> tree.tokens, tree.parents, tree.depths.tolist()
        ((5, 6, 7, 8), (-1, 0, 0, -1), [1, 2, 2, 1])
    """

    tokens: tuple[int, ...]  # [n] draft token ids
    parents: tuple[int, ...]  # [n] parent node index, -1 for a child of the root
    # [n, vocab] the draft distribution each node's token was drawn from (siblings share their
    # parent's); None for drafts without probabilities (the trie)
    draft_probs: torch.Tensor | None = field(default=None, compare=False, repr=False)
    # [n] each node's probability by its drafter (a model's path probability, the trie's share
    # of what followed); None where unknown: merges rank nodes by it
    scores: tuple[float, ...] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            msg = "a TokenTree needs one parent per token"
            raise ValueError(msg)
        if self.draft_probs is not None and (self.draft_probs.dim() != 2
                                             or self.draft_probs.shape[0] != len(self.tokens)):
            msg = "draft_probs needs one row per token: shape [n, vocab]"
            raise ValueError(msg)
        if self.scores is not None and len(self.scores) != len(self.tokens):
            msg = "a TokenTree needs one score per token"
            raise ValueError(msg)
        if any(not -1 <= p < i for i, p in enumerate(self.parents)):
            msg = "every parent must come before its child (parents[i] in [-1, i))"
            raise ValueError(msg)

    @classmethod
    def empty(cls) -> TokenTree:
        """No draft: the step degrades to plain one-token decoding."""
        return cls((), ())

    @classmethod
    def from_paths(cls, paths: Sequence[Sequence[int]]) -> TokenTree:
        """Merge token paths (each starting below the root) into one tree, sharing prefixes."""
        tokens: list[int] = []
        parents: list[int] = []
        node_of: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for path in paths:
            parent = -1
            for token in path:
                key = (parent, int(token))
                if key not in node_of:
                    node_of[key] = len(tokens)
                    tokens.append(int(token))
                    parents.append(parent)
                parent = node_of[key]
        return cls(tuple(tokens), tuple(parents))

    def merged(self, other: TokenTree, budget: int) -> TokenTree:
        """This tree plus ``other``'s nodes (in ``other``'s order, shared prefixes once) while
        the total stays within ``budget``. ``other`` must carry no probabilities: where this
        tree has them, ``other``'s nodes get one-hot rows (deterministic children), listed
        after this tree's children of the same parent.

        Examples:
            >>> a, b = TokenTree.from_paths([[5, 6]]), TokenTree.from_paths([[5, 7], [8]])
            >>> a.merged(b, budget=3).tokens  # 5 is shared; 8 does not fit
            (5, 6, 7)
        """
        if other.draft_probs is not None:
            msg = "only the first tree of a merge may carry draft probabilities"
            raise ValueError(msg)
        tokens, parents = list(self.tokens), list(self.parents)
        node_of = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens))}
        mapped: dict[int, int] = {-1: -1}
        for i, (token, parent) in enumerate(zip(other.tokens, other.parents)):
            if parent not in mapped:
                continue
            key = (mapped[parent], token)
            if key not in node_of:
                if len(tokens) >= budget:
                    continue
                node_of[key] = len(tokens)
                tokens.append(token)
                parents.append(key[0])
            mapped[i] = node_of[key]
        probs = self.draft_probs
        if probs is not None and len(tokens) > len(self):
            extra = torch.zeros(len(tokens) - len(self), probs.shape[1], dtype=probs.dtype)
            extra[torch.arange(len(extra)), torch.tensor(tokens[len(self):])] = 1.0
            probs = torch.cat([probs, extra])
        return TokenTree(tuple(tokens), tuple(parents), draft_probs=probs)

    def ranked(self, scores: Sequence[float]) -> TokenTree:
        """The same tree, its nodes ordered by ``scores`` (best first; a child scores no more
        than its parent, as a path probability, and comes after it): a cut to its first nodes
        keeps the likeliest ones. The result keeps the scores.

        Examples:
            >>> tree = TokenTree.from_paths([[5, 6], [7]])
            >>> tree.ranked([0.5, 0.4, 0.45]).tokens  # 7 (0.45) before 6 (0.4)
            (5, 7, 6)
        """
        depths = self.depths
        order = sorted(range(len(self)), key=lambda i: (-scores[i], depths[i], i))
        where = {-1: -1} | {node: i for i, node in enumerate(order)}
        probs = None if self.draft_probs is None else self.draft_probs[order]
        return TokenTree(tuple(self.tokens[i] for i in order),
                         tuple(where[self.parents[i]] for i in order), probs,
                         tuple(float(scores[i]) for i in order))

    def first(self, n: int) -> TokenTree:
        """The tree of the first ``n`` nodes (parents come before children, so it is one).

        Examples:
            >>> TokenTree.from_paths([[5, 6], [7]]).first(2).tokens
            (5, 6)
        """
        if n >= len(self):
            return self
        probs = None if self.draft_probs is None else self.draft_probs[:n]
        scores = None if self.scores is None else self.scores[:n]
        return TokenTree(self.tokens[:n], self.parents[:n], probs, scores)

    def __len__(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> np.ndarray:
        """[n] distance from the root (children of the root have depth 1)."""
        depths = np.zeros(len(self), dtype=np.int64)
        for i, p in enumerate(self.parents):
            depths[i] = 1 if p < 0 else depths[p] + 1
        return depths

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """[n, n] bool: ``mask[i, j]`` is True when node j is node i or one of its ancestors."""
        mask = np.eye(len(self), dtype=bool)
        for i, p in enumerate(self.parents):
            if p >= 0:
                mask[i] |= mask[p]
        return mask

    def children(self, node: int) -> list[int]:
        """Nodes directly below ``node`` (-1 for the root), in order."""
        return [i for i, p in enumerate(self.parents) if p == node]

    def follow(self, tokens: Sequence[int]) -> list[int]:
        """The node path that ``tokens`` (continuing below the root) walk, as far as it goes.

        Examples:
            >>> TokenTree.from_paths([[5, 6], [5, 7]]).follow([5, 7, 9])
            [0, 2]
        """
        path: list[int] = []
        for token in tokens:
            node = path[-1] if path else -1
            child = next((c for c in self.children(node) if self.tokens[c] == token), None)
            if child is None:
                break
            path.append(child)
        return path

    def path_tokens(self, nodes: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in nodes]

    @cached_property
    def paths(self) -> list[tuple[int, ...]]:
        """Each node's tokens from below the root down to it.

        Examples:
            >>> TokenTree.from_paths([[5, 6], [5, 7]]).paths
            [(5,), (5, 6), (5, 7)]
        """
        paths: list[tuple[int, ...]] = []
        for token, parent in zip(self.tokens, self.parents):
            paths.append((*paths[parent], token) if parent >= 0 else (token,))
        return paths
