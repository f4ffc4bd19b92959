"""The n-gram trie and the trie drafter: what is drafted, and memory bounds."""

import random
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_spec.drafters.trie import BYTES_PER_NODE, NGramTrie, best_nodes
from rag_spec.drafters.trie_drafter import TrieDrafter


def count_nodes(trie: NGramTrie) -> int:
    def below(children):
        return sum(1 + below(entry[1]) for entry in children.values())
    return sum(below(c) for c in trie.roots.values())


def test_longest_key_wins():
    trie = NGramTrie(branch_length=3, max_key=2)
    trie.insert([1, 2, 3, 4, 9, 2, 5, 6])
    # Key (1, 2) saw only 3 -> 4; key (2,) saw both 3 and 5.
    assert set(trie.continuations([7, 1, 2])) == {3}
    assert set(trie.continuations([7, 9, 2])) == {5}  # key (9, 2) saw only 5
    assert set(trie.continuations([7, 8, 2])) == {3, 5}  # falls back to (2,)
    assert trie.continuations([7, 8]) is None


def test_best_nodes_are_the_most_frequent_prefix_closed():
    trie = NGramTrie(branch_length=2, max_key=1)
    trie.insert([1, 2, 3, 1, 2, 3, 1, 4, 5])  # after 1: "2 3" twice, "4 5" once
    tokens, parents, shares = best_nodes([(trie.continuations([1]), 1.0)], budget=3,
                                         max_depth=2)
    assert tokens == [2, 3, 4]
    assert parents == [-1, 0, -1]
    assert shares == pytest.approx([2 / 3, 2 / 3, 1 / 3])  # "3" always followed "1 2"


def test_streamed_insert_counts_like_one_insert():
    whole = NGramTrie(branch_length=4, max_key=3)
    whole.insert([5, 1, 2, 3, 4, 1, 2, 3])
    streamed = NGramTrie(branch_length=4, max_key=3)
    streamed.insert([5, 1, 2])
    streamed.insert([5, 1, 2, 3, 4, 1], 3)
    streamed.insert([5, 1, 2, 3, 4, 1, 2, 3], 6)
    assert streamed.roots == whole.roots


@settings(max_examples=50, deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=40), max_size=30),
       st.integers(5, 200))
def test_decay_keeps_node_count_within_bound(sequences, max_nodes):
    trie = NGramTrie(branch_length=4, max_key=2, max_nodes=max_nodes)
    for seq in sequences:
        trie.insert(seq)
        assert trie.nodes <= max_nodes
        assert trie.nodes == count_nodes(trie)


def test_drafts_continue_text_seen_in_the_prompt():
    drafter = TrieDrafter(branch_length=3)
    session = drafter.session([10, 11, 12, 13, 20, 10, 11])
    tree = session.propose([10, 11], budget=4)
    assert tree.tokens[:2] == (12, 13)  # the prompt continued "10 11" with "12 13"


def test_context_documents_feed_drafts():
    drafter = TrieDrafter(branch_length=2)
    session = drafter.session([1, 2], extra_context=[[7, 8, 9]])
    assert session.propose([4, 7], budget=2).tokens == (8, 9)


def test_outputs_are_remembered_across_requests():
    drafter = TrieDrafter(branch_length=2)
    drafter.session([1]).finish([30, 31, 32])
    assert drafter.session([5]).propose([30], budget=2).tokens == (31, 32)


def test_chains_mode_gives_separate_branches():
    drafter = TrieDrafter(branch_length=3, mode="chains")
    session = drafter.session([1, 2, 3, 4, 1, 5, 6, 7, 1, 2, 3, 4])
    tree = session.propose([1], budget=6)
    assert tree.parents.count(-1) == 2  # two branches: "2 3 4" and "5 6 7"
    assert len(tree) == 6


def deep_size(obj) -> int:
    """Bytes held by nested dicts, lists, tuples and ints (the trie's only object kinds)."""
    size = sys.getsizeof(obj)
    if isinstance(obj, dict):
        size += sum(deep_size(k) + deep_size(v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        size += sum(deep_size(v) for v in obj)
    return size


def test_memory_stays_under_budget_over_10000_requests():
    memory_mb = 1.0
    drafter = TrieDrafter(branch_length=8, memory_mb=memory_mb)
    rng = random.Random(0)
    peak = 0
    for i in range(10_000):
        drafter.remember([rng.randrange(2000) for _ in range(30)])
        if i % 1000 == 999:
            peak = max(peak, deep_size(drafter.memory.roots))
    assert drafter.memory.nodes <= drafter.memory.max_nodes
    # The node bound converts to bytes with BYTES_PER_NODE; the real footprint must honour it.
    assert peak <= memory_mb * 2**20, (peak, BYTES_PER_NODE)
