"""TokenTree construction, depths and ancestor masks."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from rag_spec.target.tree import TokenTree


def test_from_paths_shares_prefixes():
    # [5, 6] and [5, 7] share the node for 5; [8] starts a second branch.
    tree = TokenTree.from_paths([[5, 6], [5, 7], [8]])
    assert tree.tokens == (5, 6, 7, 8)
    assert tree.parents == (-1, 0, 0, -1)
    assert tree.depths.tolist() == [1, 2, 2, 1]


def test_empty_tree_is_a_tree_not_none():
    tree = TokenTree.empty()
    assert len(tree) == 0
    assert tree.ancestor_mask.shape == (0, 0)


def test_parent_after_child_is_rejected():
    with pytest.raises(ValueError, match="parent"):
        TokenTree((1, 2), (1, -1))


paths = st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=5), max_size=8)


@given(paths)
def test_each_node_attends_exactly_to_its_ancestors(path_list):
    tree = TokenTree.from_paths(path_list)
    for i in range(len(tree)):
        expected = set()
        node = i
        while node >= 0:
            expected.add(node)
            node = tree.parents[node]
        assert set(np.flatnonzero(tree.ancestor_mask[i]).tolist()) == expected
        assert tree.depths[i] == len(expected)


@given(paths)
def test_every_path_is_in_the_tree_once(path_list):
    tree = TokenTree.from_paths(path_list)
    seen = set()
    for i in range(len(tree)):
        chain = []
        node = i
        while node >= 0:
            chain.append(tree.tokens[node])
            node = tree.parents[node]
        seen.add(tuple(reversed(chain)))
    assert len(seen) == len(tree)  # no duplicate root-to-node chains
    for path in path_list:
        for end in range(1, len(path) + 1):
            assert tuple(path[:end]) in seen


@given(paths, st.randoms(use_true_random=False))
def test_a_ranked_tree_keeps_its_paths_likeliest_first(path_list, rng):
    tree = TokenTree.from_paths(path_list)
    scores: list[float] = []  # a path probability: a child no likelier than its parent
    for parent in tree.parents:
        scores.append((1.0 if parent < 0 else scores[parent]) * rng.choice([1.0, 0.5, 0.1]))
    ranked = tree.ranked(scores)  # a TokenTree: parents still come before children

    def chains(t: TokenTree) -> list[tuple[int, ...]]:
        out = []
        for i in range(len(t)):
            chain, node = [], i
            while node >= 0:
                chain.append(t.tokens[node])
                node = t.parents[node]
            out.append(tuple(reversed(chain)))
        return out

    assert sorted(chains(ranked)) == sorted(chains(tree))
    by_chain = dict(zip(chains(tree), scores))
    ranked_scores = [by_chain[c] for c in chains(ranked)]
    assert ranked_scores == sorted(ranked_scores, reverse=True)  # a cut keeps the likeliest
