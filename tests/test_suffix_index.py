"""The corpus's suffix index: longest matches and continuations equal a brute-force scan, and
the trie drafter merges them without changing a greedy token."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from rag_spec.drafters.suffix_index import SuffixIndex
from rag_spec.drafters.trie_drafter import TrieDrafter
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from test_decoder_greedy import hf_greedy, repetitive_prompt


def occurrences(documents, pattern):
    """Where ``pattern`` starts, in every document (matches never cross two)."""
    m = len(pattern)
    return [(d, i) for d, doc in enumerate(documents) for i in range(len(doc) - m + 1)
            if doc[i:i + m] == pattern]


def longest(documents, context, most):
    for k in range(min(most, len(context)), 0, -1):
        if occurrences(documents, list(context[-k:])):
            return k
    return 0


def flatten(children, prefix=()):
    """Each path of a continuation trie with its count."""
    for token, (count, below) in children.items():
        yield (*prefix, token), count
        yield from flatten(below, (*prefix, token))


corpora = st.lists(st.lists(st.integers(0, 5), max_size=30), min_size=1, max_size=5)
contexts = st.lists(st.integers(0, 5), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(corpora, contexts, st.integers(1, 8))
def test_matches_and_continuations_equal_a_brute_force_scan(documents, context, depth):
    index = SuffixIndex(documents, max_match=6, max_occurrences=10**6, min_match=1)
    length = longest(documents, context, 6)
    assert index.longest_match(context) == (length, len(occurrences(documents,
                                                                      context[-length:]))
                                            if length else 0)
    children, found = index.continuations(context, depth)
    assert found == length
    expected: Counter = Counter()
    if length:
        for d, i in occurrences(documents, list(context[-length:])):
            after = documents[d][i + length:i + length + min(depth, 2 * length)]
            for j in range(1, len(after) + 1):
                expected[tuple(after[:j])] += 1
    assert dict(flatten(children or {})) == dict(expected)


def test_many_occurrences_are_sampled_across_what_follows():
    documents = [[7, 1]] * 90 + [[7, 2]] * 10  # 7 is followed by 1 nine times in ten
    index = SuffixIndex(documents, max_occurrences=20, min_match=1)
    children, _ = index.continuations([7], depth=1)
    assert sum(count for count, _ in children.values()) == 20
    assert children[1][0] == 18 and children[2][0] == 2


def test_an_empty_corpus_drafts_nothing():
    index = SuffixIndex([[], []])
    assert len(index) == 0 and index.continuations([1, 2], 4) == (None, 0)


def test_the_corpus_drafts_what_followed_its_match():
    drafter = TrieDrafter(corpus=SuffixIndex([[1, 2, 3, 4, 5, 6, 7]], min_match=2),
                          memory_mb=0)
    session = drafter.session([9, 9, 8])  # nothing to copy from the prompt
    assert session.propose([9, 9, 8], budget=8).tokens == ()
    assert session.propose([9, 9, 3], budget=8).tokens == ()  # a match shorter than min_match
    assert session.propose([9, 2, 3], budget=8).tokens == (4, 5, 6, 7)  # the match "2 3"
    assert drafter.label == "trie + corpus"


def test_corpus_drafts_keep_greedy_tokens_and_are_accepted(model):
    prompt = repetitive_prompt(3)
    expected = hf_greedy(model, prompt, 40)
    # the corpus holds the answer (as a knowledge base holds what answers copy), not the prompt
    index = SuffixIndex([prompt[-6:] + expected, repetitive_prompt(5)], min_match=2)
    corpus = LookaheadDecoder(model, config=LookaheadConfig(budget=8),
                              drafter=TrieDrafter(corpus=index, memory_mb=0))
    alone = LookaheadDecoder(model, config=LookaheadConfig(budget=8),
                             drafter=TrieDrafter(memory_mb=0))
    with_corpus, without = (d.generate(prompt, max_new_tokens=40) for d in (corpus, alone))
    assert with_corpus.token_ids == without.token_ids == expected
    assert with_corpus.stats.tokens_per_step > without.stats.tokens_per_step


def test_sampling_with_corpus_drafts_keeps_plain_samplings_distribution(model):
    from lab.corpus_drafts import CorpusOnly
    from test_sampling import KNOBS, PROMPT, N, assert_plain_sampling

    knobs = KNOBS["top_p"]
    greedy = LookaheadDecoder(model).generate(PROMPT, max_new_tokens=3).token_ids
    # the corpus alone drafts (no n-grams of the prompt or the answer, no memory): the greedy
    # path, which the samples often take
    index = SuffixIndex([PROMPT + greedy], min_match=2)
    decoder = ablated(model, drafter=CorpusOnly(index), adaptive=False)
    results = decoder.generate([PROMPT] * N, max_new_tokens=2, do_sample=True, seed=7, **knobs)
    assert sum(sum(r.stats.accepted_per_step) for r in results) > N // 10  # drafts were kept
    assert_plain_sampling(model, results, knobs)
