"""The n-gram trie and the trie drafter: what is drafted, and memory bounds."""

import gc
import random
import sys
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rag_spec.drafters.trie import BYTES_PER_NODE, NGramTrie, best_nodes
from rag_spec.drafters.trie_drafter import TrieDrafter


def nested(trie: NGramTrie) -> dict:
    """Every key's continuations as nested dicts: token -> (count, what followed), in order."""
    def below(level):
        return {token: (count, below(after)) for token, (count, after) in level.items()}
    return {key: below(trie.following(key)) for key in trie.roots}


def count_nodes(trie: NGramTrie) -> int:
    def below(children):
        return sum(1 + below(after) for _, after in children.values())
    return sum(below(c) for c in nested(trie).values())


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
    assert nested(streamed) == nested(whole)


def flattened(trie: NGramTrie) -> Counter:
    """(key, path) -> count for every node of every key's continuations."""
    counts: Counter = Counter()

    def walk(key, path, level):
        for token, (count, after) in level.items():
            counts[key, (*path, token)] = count
            walk(key, (*path, token), after)
    for key, level in nested(trie).items():
        walk(key, (), level)
    return counts


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 6), max_size=30), min_size=1, max_size=4),
       st.integers(1, 5), st.integers(1, 3))
def test_counts_are_the_n_grams_counted_directly(sequences, branch_length, max_key):
    trie = NGramTrie(branch_length=branch_length, max_key=max_key)
    direct: Counter = Counter()
    for tokens in sequences:
        trie.insert(tokens)
        for start in range(1, len(tokens)):
            for q in range(1, min(max_key, start) + 1):
                for d in range(1, min(branch_length, len(tokens) - start) + 1):
                    direct[tuple(tokens[start - q:start]), tuple(tokens[start:start + d])] += 1
    assert flattened(trie) == direct
    assert trie.nodes == len(direct)


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


def test_a_copy_only_earlier_answers_hold_counts_less():
    """The request's own continuation keeps its share; one only the memory holds (and what
    follows it) counts ``RECALLED_TRUST`` of its share, so a merged tree ranks it after the
    head's likely guesses; where the request holds it too, nothing is discounted."""
    from rag_spec.drafters.trie_drafter import RECALLED_TRUST

    drafter = TrieDrafter(branch_length=2)
    drafter.session([1]).finish([30, 40, 41])  # an earlier answer: 30 -> 40 41
    session = drafter.session([30, 50, 51])  # this request: 30 -> 50 51
    tree = session.propose([30], budget=4)
    share = dict(zip(tree.paths, tree.scores))
    plain = TrieDrafter(branch_length=2, memory_mb=0).session([30, 50, 51]).propose([30], 4)
    assert set(share) == {(50,), (50, 51), (40,), (40, 41)}
    # counted alone, 50 follows 30 in 4 of 5 weighted sightings (the request's weigh 4), 40 in 1
    assert share[(50,)] == pytest.approx(0.8) and share[(50, 51)] == pytest.approx(0.8)
    assert share[(40,)] == pytest.approx(0.2 * RECALLED_TRUST)
    assert share[(40, 41)] == pytest.approx(0.2 * RECALLED_TRUST)  # its subtree, once
    assert plain.tokens == (50, 51)
    # only the memory continues "40": discounted from its first node
    recalled = drafter.session([7]).propose([40], budget=2)
    assert recalled.tokens == (41,) and recalled.scores == pytest.approx((RECALLED_TRUST,))
    # the request holds the same continuation: counted as it is
    both = drafter.session([30, 40, 41]).propose([30], budget=2)
    assert both.tokens == (40, 41) and both.scores == pytest.approx((1.0, 1.0))


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


@pytest.mark.slow
def test_memory_stays_under_budget_over_10000_requests():
    memory_mb = 1.0
    drafter = TrieDrafter(branch_length=8, memory_mb=memory_mb)
    rng = random.Random(0)
    peak = 0
    for i in range(10_000):
        drafter.remember([rng.randrange(2000) for _ in range(30)])
        if i % 1000 == 999:
            peak = max(peak, deep_size(vars(drafter.memory)))
    assert drafter.memory.nodes <= drafter.memory.max_nodes
    # The node bound converts to bytes with BYTES_PER_NODE; the real footprint must honour it.
    assert peak <= memory_mb * 2**20, (peak, BYTES_PER_NODE)


def tracked_below(root: object) -> int:
    """Objects reachable from ``root`` that Python's garbage collector tracks (walks)."""
    seen, stack, tracked = set(), [root], 0
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        tracked += gc.is_tracked(obj)
        stack.extend(gc.get_referents(obj))
    return tracked


def test_a_trie_of_thousands_of_nodes_gives_the_collector_a_handful_of_objects():
    # a full collection walks every tracked object: an object or two per node made requests
    # with long prompts (and the memory of earlier answers) pay for walking all of them
    trie = NGramTrie(branch_length=8, max_key=3)
    rng = random.Random(0)
    text = [rng.randrange(500) for _ in range(2000)]
    trie.insert(text)
    trie.insert(text)  # every count 2
    twice = trie.nodes
    trie.insert([rng.randrange(500, 1000) for _ in range(500)])  # new keys, counts 1
    trie.max_nodes = twice
    trie.decay()  # halved: the text's nodes kept, the rest dropped, in lists rebuilt
    gc.collect()  # key tuples of ints are untracked at their first collection
    assert trie.nodes == twice > 10_000
    assert tracked_below(trie) < 10
