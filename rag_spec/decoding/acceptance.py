"""Which drafted tokens to keep: the longest tree path the target model agrees with, plus a bonus.

``choices[0]`` is the target's token after the root (the last committed token) and
``choices[1 + i]`` its token after node ``i``. For greedy decoding a choice is the argmax; for
sampling it is one sample from the target's processed distribution at that node. Walking the
tree along the choices is then exactly sequential decoding (sample-and-match): every emitted
token is the target's own choice given everything before it, so the output distribution is the
target's, whatever the draft was. Drafts from the trie carry no probabilities, so no ratio test
is needed.
"""

from __future__ import annotations

from collections.abc import Sequence

from rag_spec.decoding.tree import TokenTree


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
