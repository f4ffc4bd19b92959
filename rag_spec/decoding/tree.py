"""The draft every drafter proposes and the verifier checks: a tree of tokens.

The root is implicit: it is the last committed token, whose next-token logits come from the same
forward pass. Node ``i`` holds ``tokens[i]`` and hangs below ``parents[i]`` (-1 = the root);
parents always come before their children, so a tree is a prefix-closed list of paths.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
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

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents):
            msg = "a TokenTree needs one parent per token"
            raise ValueError(msg)
        if self.draft_probs is not None and (self.draft_probs.dim() != 2
                                             or self.draft_probs.shape[0] != len(self.tokens)):
            msg = "draft_probs needs one row per token: shape [n, vocab]"
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

    def path_tokens(self, nodes: Sequence[int]) -> list[int]:
        return [self.tokens[i] for i in nodes]
