"""Which drafted tokens to keep: the longest tree path the target model agrees with, plus a bonus.

``choices[0]`` is the target's token after the root (the last committed token) and
``choices[1 + i]`` its token after node ``i``. For greedy decoding a choice is the argmax; for
sampling it is one sample from the target's processed distribution at that node. Walking the
tree along the choices is then exactly sequential decoding (sample-and-match): every emitted
token is the target's own choice given everything before it, so the output distribution is the
target's, whatever the draft was. Drafts from the trie carry no probabilities, so no ratio test
is needed.

Drafts that carry ``draft_probs`` are verified by multi-step speculative sampling
(``accept_speculative``, SpecInfer's rule): it keeps the target's distribution too, and accepts
a child x drawn from q with probability min(1, p(x) / q(x)) instead of p(x).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from rag_spec.target.tree import TokenTree


def accept(tree: TokenTree, choices: Sequence[int]) -> tuple[list[int], int]:
    """The accepted node path and the bonus token.

    Examples:
        >>> tree = TokenTree.from_paths([[5, 6], [5, 7]])
        >>> accept(tree, [5, 9, 0, 0])   # target picks 5 at the root, then 9: node 0 accepted
        ([0], 9)
        >>> accept(tree, [5, 7, 0, 4])   # 5 then 7 matches node 2; after node 2 the target picks 4
        ([0, 2], 4)
    """
    path: list[int] = []
    node = -1
    while True:
        want = int(choices[node + 1])
        child = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if child is None:
            return path, want
        path.append(child)
        node = child


def accept_speculative(tree: TokenTree, target_probs: torch.Tensor, rand: Callable[[], float]
                       ) -> tuple[list[int], int]:
    """Multi-step speculative sampling over a tree whose nodes carry ``draft_probs``.

    At each node, with p the target's distribution there, the children are tried in order:
    child x drawn from q is accepted when ``u * q(x) < p(x)``; otherwise p becomes
    norm(max(0, p - q)) and the next child is tried. No child accepted: the token is sampled
    from what is left of p (*recovered*); no children at all: from p itself (*bonus*).

    Children of one parent drawn from the same distribution (equal ``draft_probs`` rows) are
    taken to be drawn without replacement, in order: q drops the earlier siblings' tokens
    (Sequoia's variant, which accepts more than drawing with replacement). A one-hot row is a
    deterministic child (a trie's copy): accepted with probability p(x), exactly
    sample-and-match. Each step keeps p's distribution whatever q was, so the output has the
    target's distribution.

    Args:
        target_probs: [1 + n, vocab] the target's sampling distribution after the root and after
            each node.
        rand: fresh uniform numbers in [0, 1).

    Examples:
        >>> import torch
        >>> q = torch.tensor([[0.5, 0.5, 0.0]])
        >>> tree = TokenTree((1,), (-1,), draft_probs=q)
        >>> p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
        >>> accept_speculative(tree, p, lambda: 0.99)  # p(1) = 1 >= q(1): always accepted
        ([0], 2)
    """
    assert tree.draft_probs is not None
    draft = tree.draft_probs.double()
    path: list[int] = []
    node = -1
    while True:
        p = target_probs[node + 1].double()
        tried: list[int] = []
        for child in tree.children(node):
            token = tree.tokens[child]
            q = _without(draft[child], [s for s in tried if torch.equal(draft[s], draft[child])],
                         tree)
            if q[token] <= 0:  # not drawn from this row: a deterministic child
                q = torch.zeros_like(p)
                q[token] = 1.0
            if rand() * q[token] < p[token]:
                path.append(child)
                break
            p = _normalised((p - q).clamp(min=0), p)
            tried.append(child)
        else:
            return path, _sample(p, rand())
        node = path[-1]


def _without(q: torch.Tensor, siblings: Sequence[int], tree: TokenTree) -> torch.Tensor:
    """q with the earlier siblings' tokens removed, renormalised (drawing without replacement)."""
    if not siblings:
        return q
    q = q.clone()
    q[[tree.tokens[s] for s in siblings]] = 0
    return _normalised(q, q)


def _normalised(weights: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = weights.sum()
    return weights / total if total > 0 else fallback


def _sample(p: torch.Tensor, u: float) -> int:
    """Inverse-CDF sample of p with the uniform number u (zero-probability tokens never)."""
    cdf = p.cumsum(0)
    return int(torch.searchsorted(cdf, u * cdf[-1], right=True).clamp(max=len(p) - 1))
