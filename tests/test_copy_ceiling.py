"""The copy ceiling: the fewest passes a drafter that copies needs, and a bound on our trie."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import tiny_llama
from rag_spec.bench.ceiling import copy_ceiling, copy_passes
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder
from test_decoder_greedy import repetitive_prompt


def test_an_answer_copied_from_the_prompt_takes_a_pass_for_its_first_token_and_one_more():
    # the first token follows nothing seen before; then 2 is found in the prompt, and 3 4 5
    # after it are copied, with the verifier's own token making the fourth
    assert copy_passes([1, 2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5]) == 2
    assert copy_ceiling([1, 2, 3, 4, 5, 6, 7, 8, 9], [2, 3, 4, 5]) == 2.0


def test_nothing_to_copy_is_one_token_a_pass():
    assert copy_passes([1, 2, 3], [4, 5, 6, 7]) == 4


def test_copies_are_at_most_longest_tokens():
    prompt = list(range(1, 40))
    assert copy_passes(prompt, prompt[1:33], longest=8) == 1 + 4  # 1 + (31 copied / (8 + 1))
    assert copy_passes(prompt, prompt[1:33], longest=30) == 2


def test_the_fewest_passes_are_not_the_greedy_walks():
    # After 7 the longest copy is "1 2" (bonus 3), which leads on to nothing;
    # copying just "1" lands on 2, after which "8 9 10" follow in the prompt.
    prompt = [7, 1, 2, 4, 2, 8, 9, 10, 11, 7]
    answer = [1, 2, 8, 9, 10, 11]
    assert copy_passes(prompt, answer) == 2  # 1 (first token), then "2 8 9 10" + 11


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), min_size=1,
                                                         max_size=30), st.integers(1, 8))
def test_a_pass_commits_between_one_and_longest_plus_one_tokens(prompt, answer, longest):
    passes = copy_passes(prompt, answer, longest)
    assert -(-len(answer) // (longest + 1)) <= passes <= len(answer)
    assert copy_passes(prompt, answer, longest + 1) <= passes  # longer copies never cost passes


def test_our_trie_without_memory_never_needs_fewer_passes_than_the_ceiling():
    model = tiny_llama(vocab_size=16)
    forgetful = LookaheadDecoder(model, config=LookaheadConfig(memory_mb=0))
    remembering = LookaheadDecoder(model)
    copied = 0
    for seed in range(3):
        prompt = repetitive_prompt(seed, vocab=16)
        result = forgetful.generate(prompt, max_new_tokens=60)
        passes = copy_passes(prompt, result.token_ids)
        assert result.stats.steps >= passes
        copied += sum(result.stats.accepted_per_step)
        # what the ceiling leaves out: a trie that remembers this answer copies past it
        remembering.generate(prompt, max_new_tokens=60)
        assert remembering.generate(prompt, max_new_tokens=60).stats.steps < passes
    assert copied  # the forgetful trie did copy: the bound was put to the test
