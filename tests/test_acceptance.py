"""Acceptance on hand-built choices: accepted path and bonus token."""

from rag_spec.engine.verify.acceptance import accept
from rag_spec.target.tree import TokenTree

TREE = TokenTree.from_paths([[5, 6, 7], [5, 8], [9]])  # nodes: 5,6,7,8,9


def test_empty_tree_gives_only_the_bonus():
    # No draft: the step is plain decoding, the target's root choice is the bonus.
    assert accept(TokenTree.empty(), [4]) == ([], 4)


def test_root_mismatch_accepts_nothing():
    # The target wants 3 after the root; no child holds 3.
    assert accept(TREE, [3, 0, 0, 0, 0, 0]) == ([], 3)


def test_full_branch_then_bonus():
    # 5 -> 6 -> 7 all match, then the target's choice after node 2 (token 7) is the bonus.
    assert accept(TREE, [5, 6, 7, 1, 0, 0]) == ([0, 1, 2], 1)


def test_second_child_is_followed():
    # After 5 the target picks 8, which is node 3, not node 1.
    assert accept(TREE, [5, 8, 0, 0, 2, 0]) == ([0, 3], 2)


def test_second_root_branch():
    # The target picks 9 at the root (node 4), then 6 after it.
    assert accept(TREE, [9, 0, 0, 0, 0, 6]) == ([4], 6)
