"""LangChain adapters on a tiny model folder: same tokens as transformers, real streaming,
exact stops, non-blocking async, real batching, and errors that surface through chains."""

import asyncio

import pytest
import torch
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.runnables import RunnableLambda

from conftest import HashRetriever
from langchain_rag_spec import ChatLookahead, IterativeRaLM, LookaheadLLM, SpecRetriever
from rag_spec.engine.batch import LiveBatch
from rag_spec.models import load_model
from rag_spec.serving.local_lm import LocalLM

MAX = 24


@pytest.fixture
def chat(tiny_model_dir):
    return ChatLookahead(model=tiny_model_dir, max_tokens=MAX)


@pytest.fixture
def completer(tiny_model_dir):
    return LookaheadLLM(model=tiny_model_dir, max_tokens=MAX)


def greedy(folder, prompt_ids, max_new_tokens=MAX):
    """transformers' own greedy decoding: the reference every adapter must match."""
    lm = load_model(folder)
    ids = torch.tensor([prompt_ids])  # the mask keeps pad-valued prompt tokens visible
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids),
                            max_new_tokens=max_new_tokens, do_sample=False)
    return lm.tokenizer.decode(out[0, len(prompt_ids):], skip_special_tokens=True)


def test_chat_invoke_equals_transformers_greedy(chat, tiny_model_dir):
    messages = [SystemMessage("be brief."), HumanMessage("hello there")]
    reply = chat.invoke(messages)
    prompt = LocalLM.shared(tiny_model_dir).encode(
        [{"role": "system", "content": "be brief."}, {"role": "user", "content": "hello there"}])
    assert reply.content == greedy(tiny_model_dir, prompt)
    assert reply.usage_metadata["output_tokens"] == MAX
    assert reply.usage_metadata["input_tokens"] == len(prompt)
    assert reply.response_metadata["model_name"] == tiny_model_dir
    assert reply.response_metadata["speculation"]["tokens_per_step"] >= 1


def test_llm_returns_only_new_text_equal_to_transformers(completer, tiny_model_dir):
    prompt = "the cat sat on the mat. the cat"
    ids = load_model(tiny_model_dir).tokenizer(prompt)["input_ids"]
    assert completer.invoke(prompt) == greedy(tiny_model_dir, ids)


def test_stream_yields_chunks_that_join_to_invoke(chat):
    chunks = list(chat.stream("hello there"))
    assert len(chunks) > 1
    assert "".join(c.content for c in chunks) == chat.invoke("hello there").content
    assert chunks[-1].chunk_position == "last"
    assert [c.usage_metadata is not None for c in chunks].count(True) == 1


def test_llm_stream_fires_token_callbacks(completer):
    class Tokens(BaseCallbackHandler):
        def __init__(self):
            self.pieces = []

        def on_llm_new_token(self, token, **kwargs):
            self.pieces.append(token)

    handler = Tokens()
    streamed = "".join(completer.stream("the cat", config={"callbacks": [handler]}))
    assert len(handler.pieces) > 1
    assert "".join(handler.pieces) == streamed == completer.invoke("the cat")


@pytest.mark.parametrize("per_call", [True, False])
def test_stop_sequences_cut_exactly(tiny_model_dir, per_call):
    free = ChatLookahead(model=tiny_model_dir, max_tokens=MAX).invoke("hello there").content
    stop = free[8:11]
    expected = free[:free.index(stop)]
    if per_call:
        cut = ChatLookahead(model=tiny_model_dir, max_tokens=MAX).invoke("hello there",
                                                                         stop=[stop])
    else:
        cut = ChatLookahead(model=tiny_model_dir, max_tokens=MAX, stop=[stop]).invoke(
            "hello there")
    assert cut.content == expected
    assert cut.response_metadata["finish_reason"] == "stop"
    streamed = "".join(c.content for c in ChatLookahead(
        model=tiny_model_dir, max_tokens=MAX).stream("hello there", stop=[stop]))
    assert streamed == expected


def test_batch_decodes_together_and_matches_invoke(chat, monkeypatch):
    batch_sizes = []
    step = LiveBatch.step

    def spy(self):
        batch_sizes.append(len(self.live))
        return step(self)

    monkeypatch.setattr(LiveBatch, "step", spy)
    inputs = ["hello there", "what is up", "a cat sat"]
    replies = chat.batch(inputs)
    assert max(batch_sizes) > 1  # concurrent invokes decoded in one batch
    assert [r.content for r in replies] == [chat.invoke(i).content for i in inputs]


async def test_async_calls_run_concurrently_without_blocking_the_loop(chat):
    calls = asyncio.ensure_future(asyncio.gather(chat.ainvoke("hello there"),
                                                 chat.ainvoke("a cat sat")))
    await asyncio.sleep(0)  # the calls start; a call that computed on the loop would finish here
    await asyncio.sleep(0)
    assert not calls.done()  # the loop is free while the model decodes elsewhere
    first, second = await calls
    streamed = [c.content async for c in chat.astream("hello there")]
    assert first.content == chat.invoke("hello there").content
    assert second.content == chat.invoke("a cat sat").content
    assert len(streamed) > 1 and "".join(streamed) == first.content


async def test_llm_async_batch(completer):
    results = await completer.abatch(["the cat", "a dog"])
    assert results == [completer.invoke("the cat"), completer.invoke("a dog")]


def test_context_documents_do_not_change_the_answer(chat):
    plain = chat.invoke("hello there").content
    with_docs = chat.with_context(["hello there, the cat sat on the mat"]).invoke("hello there")
    assert with_docs.content == plain


def test_an_early_break_in_a_stream_frees_the_model(chat):
    for _ in chat.stream("hello there"):
        break
    assert chat.invoke("hello there").content  # would hang if the model were still held


def test_retriever_k_batch_and_one_search_per_batch():
    source = HashRetriever()
    retriever = SpecRetriever(source=source, k=3)
    docs = retriever.invoke("alpha beta")
    assert len(docs) == 3 and docs[0].metadata["title"].startswith("doc")
    assert len(retriever.invoke("alpha beta", k=1)) == 1
    source.calls = 0
    results = retriever.batch([f"query {i}" for i in range(6)])
    assert [len(r) for r in results] == [3] * 6
    assert source.calls < 6  # merged into batched knowledge-base calls


def test_a_failing_retriever_surfaces_through_the_chain():
    chain = SpecRetriever(source=HashRetriever(raise_after=0)) | RunnableLambda(len)
    with pytest.raises(ConnectionError, match="knowledge base is down"):
        chain.invoke("alpha")


def test_retriever_rejects_what_it_cannot_search():
    with pytest.raises(Exception, match="cannot search a int"):
        SpecRetriever(source=3).invoke("alpha")


def test_iterative_ralm_runnable_speculative_equals_naive(chat):
    source = HashRetriever()
    naive = IterativeRaLM(llm=chat, retriever=SpecRetriever(source=source), speculative=False,
                          max_tokens=16)
    fast = IterativeRaLM(llm=chat, retriever=SpecRetriever(source=source), max_tokens=16)
    question = "alpha beta gamma"
    assert fast.invoke(question) == naive.invoke(question)
    assert (naive | RunnableLambda(str.upper)).invoke(question) == naive.invoke(question).upper()
    assert fast.invoke(question) == naive.invoke(question)  # again, on the loop kept from before
    assert len(fast._loops) == 1
    fast.stride = 2  # another setting, another loop
    fast.invoke(question)
    assert len(fast._loops) == 2


@pytest.mark.e2e
@pytest.mark.usefixtures("user_cache")
def test_iterative_ralm_answers_alike_speculative_or_not_on_the_embedded_models_gguf_weights():
    """The default chat model decodes its GGUF file's weights: both loops decode on its
    decoder, so speculative retrieval keeps the answer there too."""
    chat, source = ChatLookahead(max_tokens=64), HashRetriever()
    naive = IterativeRaLM(llm=chat, retriever=SpecRetriever(source=source), speculative=False,
                          max_tokens=64)
    fast = IterativeRaLM(llm=chat, retriever=SpecRetriever(source=source), max_tokens=64)
    question = "How do I read a CSV file?"  # float32 one-token steps answer it otherwise
    assert fast.invoke(question) == naive.invoke(question)


def test_swapping_in_a_spec_retriever_is_what_turns_speculation_on(chat):
    """As in rag_spec: the same name means the same thing in both packages."""
    from langchain_rag_spec import RagSpecRetriever

    source = HashRetriever()
    plain = IterativeRaLM(llm=chat, retriever=RagSpecRetriever(source=source), max_tokens=16)
    spec = IterativeRaLM(llm=chat, retriever=SpecRetriever(source=source), max_tokens=16)
    question = "alpha beta gamma"
    assert spec.invoke(question) == plain.invoke(question)
    ((_, _, plain_speculates, *_),) = plain._loops
    ((_, _, speculates, *_),) = spec._loops
    assert speculates and not plain_speculates
    assert SpecRetriever(source=source).invoke("alpha") == \
        RagSpecRetriever(source=source).invoke("alpha")  # elsewhere, the same retriever


@pytest.mark.parametrize("draft", ["early-exit:1", "folder", "self-spec:8"])
def test_a_draft_model_leaves_the_answer_unchanged(tiny_model_dir, draft):
    prompt = "the cat sat on the mat. the cat"
    ids = load_model(tiny_model_dir).tokenizer(prompt)["input_ids"]
    drafted = LookaheadLLM(model=tiny_model_dir, max_tokens=MAX,
                           draft_model=tiny_model_dir if draft == "folder" else draft)
    assert drafted.invoke(prompt) == greedy(tiny_model_dir, ids)
    # a batch shares the decoder's batches (the self-drafter drafts for all rows at once)
    assert drafted.batch([prompt, prompt[:20]]) == [greedy(tiny_model_dir, ids), greedy(
        tiny_model_dir, load_model(tiny_model_dir).tokenizer(prompt[:20])["input_ids"])]
    expected = "SelfSpecDrafter" if draft.startswith("self") else "MergedDrafter"
    assert type(drafted.local_lm().decoder.drafter).__name__ == expected


@pytest.mark.parametrize("setting, match", [
    ({"temperature": -1}, r"temperature must be >= 0 \(0 decodes greedily; got -1"),
    ({"top_p": 0}, r"top_p must be in \(0, 1\] \(got 0"),
    ({"top_k": -2}, r"top_k must be >= 0 \(0 turns it off; got -2\)"),
    ({"repetition_penalty": 0}, r"repetition_penalty must be > 0"),
    ({"max_tokens": 0}, r"max_new_tokens must be at least 1 \(got 0\)"),
])
def test_settings_are_checked_when_built_in_the_decoders_words(tiny_model_dir, setting, match):
    """The framework classes refuse what ``LookaheadDecoder.generate`` refuses, with the
    same sentence, at construction (not after loading a model), and per call too."""
    from llama_index.llms.rag_spec import LookaheadLLM as IndexLLM

    from rag_spec import LookaheadDecoder, RagSpecError

    index_setting = {"max_new_tokens" if k == "max_tokens" else k: v for k, v in setting.items()}
    for build in (lambda: ChatLookahead(model=tiny_model_dir, **setting),
                  lambda: LookaheadLLM(model=tiny_model_dir, **setting),
                  lambda: IndexLLM(model=tiny_model_dir, **index_setting)):
        with pytest.raises(RagSpecError, match=match):
            build()
    with pytest.raises(RagSpecError, match=match):
        ChatLookahead(model=tiny_model_dir, max_tokens=4).invoke("hi", **setting)
    core = {"temperature": -1} if "temperature" in setting else {}
    if core:  # the decoder's own check says the same of the same mistake, sampling
        lm = load_model(tiny_model_dir)
        with pytest.raises(RagSpecError, match=r"temperature must be > 0"):
            LookaheadDecoder(lm.model, lm.tokenizer).generate([3, 4], 2, do_sample=True, **core)


def test_why_an_answer_ended_is_in_the_response_metadata(tiny_model_dir):
    """``finish_reason`` in the OpenAI API's words, ``ended_by`` as the decoder says it."""
    free = ChatLookahead(model=tiny_model_dir, max_tokens=MAX).invoke("hello there")
    assert (free.response_metadata["finish_reason"], free.response_metadata["ended_by"]) == \
        ("length", "length")
    stopped = ChatLookahead(model=tiny_model_dir, max_tokens=MAX,
                            stop=[free.content[8:11]]).invoke("hello there")
    assert (stopped.response_metadata["finish_reason"],
            stopped.response_metadata["ended_by"]) == ("stop", "stop")
    last = list(ChatLookahead(model=tiny_model_dir, max_tokens=MAX).stream("hello there"))[-1]
    assert last.response_metadata["finish_reason"] == "length"
