"""Every entry point x every drafter kind on one tiny model that carries a tiny trained head:
each output equals its reference (``generate``, constrained decoding without drafts, the naive
RaLM loop). A drafter that breaks on one path only (iterative RaLM decodes through ``extend``,
with a cache the loop owns) fails here, not in a user's first answer.

kNN-LM is not a row of the matrix: it decodes without a drafter (its speculation guesses
datastore hits, ``test_knnlm.py``)."""

import pytest

from conftest import HashRetriever, char_lm, char_tokenizer
from rag_spec import (
    DraftModelDrafter,
    EarlyExitDrafter,
    FeatureDrafter,
    IterativeRaLM,
    LookaheadConfig,
    LookaheadDecoder,
    MergedDrafter,
    SelfSpecDrafter,
    SpecRetriever,
    TrieDrafter,
)
from rag_spec.bench.simulated import DelayedRetriever
from rag_spec.training.train_head import train_head
from test_decoder_greedy import hf_greedy

QUESTION = "which word comes after alpha beta?"
TEXTS = ["alpha beta gamma delta. ", "which word comes after alpha beta? gamma. ",
         "the cat sat on the mat. the cat sat. "]
N = 24


@pytest.fixture(scope="module")
def lm():
    return char_lm(window=1024)  # prompts with passages run past 256 characters


@pytest.fixture(scope="module")
def head(lm):
    sequences = [lm.tokenizer(text * 4)["input_ids"] for text in TEXTS * 6]
    return train_head(lm.model, sequences, vocabulary=24, epochs=2, lr=5e-3, progress=False)


DRAFTERS = {
    "trie": lambda lm, head: TrieDrafter(),
    "head": lambda lm, head: FeatureDrafter(head),
    "head+trie": lambda lm, head: MergedDrafter(FeatureDrafter(head), eager=True),
    # the model's twin drafts: its guesses are the target's, so acceptance is exercised
    "draft model": lambda lm, head: MergedDrafter(DraftModelDrafter(char_lm(window=1024).model),
                                                  eager=True),
    "early exit": lambda lm, head: MergedDrafter(EarlyExitDrafter(1), eager=True),
    "self-spec": lambda lm, head: SelfSpecDrafter(budget=16, sinks=2),
}


@pytest.fixture(params=list(DRAFTERS))
def decoder(request, lm, head):
    return LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=8),
                            drafter=DRAFTERS[request.param](lm, head))


def prompts(lm) -> list[list[int]]:
    return [lm.tokenizer(text * 3)["input_ids"] for text in TEXTS[:2]]


def test_greedy_batched_and_streamed_are_generates(decoder, lm):
    one, two = prompts(lm)
    expected = [hf_greedy(lm.model, p, N) for p in (one, two)]
    assert decoder.generate(one, N).token_ids == expected[0]
    assert [r.token_ids for r in decoder.generate([one, two], N)] == expected
    stream = decoder.stream(two, N)
    text = "".join(stream)
    assert stream.result.token_ids == expected[1]
    assert text == lm.tokenizer.decode(expected[1], skip_special_tokens=True)


def test_a_one_token_prompt_is_generates(decoder, lm):
    """The first pass of a one-token prompt comes before any prefill: nothing is cached yet,
    and the drafter has one token to draft from."""
    one = prompts(lm)[0][:1]
    assert decoder.generate(one, N).token_ids == hf_greedy(lm.model, one, N)
    assert [r.token_ids for r in decoder.generate([one, prompts(lm)[1]], N)] == \
        [hf_greedy(lm.model, p, N) for p in (one, prompts(lm)[1])]


def test_sampled_with_one_candidate_is_greedy(decoder, lm):
    """top_k=1 leaves one token to sample: whatever the drafts, sampling must give it (the
    distribution itself is ``test_sampling.py``'s)."""
    one, _ = prompts(lm)
    result = decoder.generate(one, N, do_sample=True, top_k=1, seed=3)
    assert result.token_ids == hf_greedy(lm.model, one, N)


def test_constrained_equals_constrained_decoding_without_drafts(decoder, lm):
    one, _ = prompts(lm)
    plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0))
    for constraint in ({"regex": "(alpha |beta |gamma )+delta\\."},
                       {"choices": ["alpha beta", "gamma delta", "the cat"]}):
        expected = plain.generate(one, N, **constraint)
        assert decoder.generate(one, N, **constraint).token_ids == expected.token_ids


@pytest.mark.parametrize("speculative", [False, True])
def test_iterative_ralm_through_extend_is_the_naive_loop(decoder, lm, speculative):
    """RaLM decodes each stride with ``extend`` on the segment's own cache; passages change
    and, speculating, rollbacks crop it."""
    source = HashRetriever()
    expected = IterativeRaLM(lm, source, stride=3).generate(QUESTION, max_new_tokens=N)
    retriever = SpecRetriever(DelayedRetriever(source, 3)) if speculative else source
    result = IterativeRaLM(lm, retriever, stride=3, lookahead=decoder).generate(
        QUESTION, max_new_tokens=N)
    assert result.token_ids == expected.token_ids


@pytest.fixture(scope="module")
def folder(lm, tmp_path_factory):
    """The matrix's model saved as a folder: what the framework classes load."""
    path = tmp_path_factory.mktemp("matrix-model")
    lm.model.save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", list(DRAFTERS))
def test_the_framework_classes_answer_as_generate(kind, lm, head, folder):
    from llama_index.llms.rag_spec import LookaheadLLM as IndexLLM

    from langchain_rag_spec import LookaheadLLM

    prompt = TEXTS[2] * 2
    expected = lm.tokenizer.decode(hf_greedy(lm.model, lm.tokenizer(prompt)["input_ids"], N),
                                   skip_special_tokens=True)
    drafter = DRAFTERS[kind](lm, head)
    chain = LookaheadLLM(model=folder, max_tokens=N, draft_model=drafter)
    assert chain.invoke(prompt) == expected
    assert chain.local_lm().decoder.drafter is drafter
    index = IndexLLM(model=folder, max_new_tokens=N, draft_model=drafter)
    assert index.complete(prompt).text == expected
