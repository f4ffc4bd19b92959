"""LlamaIndex adapters: the LLM on a tiny model folder (same tokens as transformers, streaming,
async), then query engines end to end on the embedded model and knowledge base."""

import asyncio

import pytest
import torch
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.llms import ChatMessage
from llama_index.core.query_engine import RetrieverQueryEngine
from llama_index.embeddings.rag_spec import RagSpecEmbedding
from llama_index.llms.rag_spec import LookaheadLLM
from llama_index.retrievers.rag_spec import RagSpecRetriever

from conftest import HashRetriever
from rag_spec.models import load_model
from rag_spec.serving.local_lm import LocalLM


@pytest.fixture
def llm(tiny_model_dir):
    return LookaheadLLM(model=tiny_model_dir, max_new_tokens=24)


def test_complete_equals_transformers_greedy(llm, tiny_model_dir):
    lm = load_model(tiny_model_dir)
    ids = torch.tensor([lm.tokenizer("the cat sat")["input_ids"]])
    out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                            do_sample=False)
    expected = lm.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    response = llm.complete("the cat sat")
    assert response.text == expected
    assert response.additional_kwargs["completion_tokens"] == out.shape[1] - ids.shape[1]


def test_chat_applies_the_chat_prompt_and_streams_deltas(llm, tiny_model_dir):
    messages = [ChatMessage(role="user", content="hello there")]
    reply = llm.chat(messages)
    prompt = LocalLM.shared(tiny_model_dir).encode([{"role": "user", "content": "hello there"}])
    assert reply.additional_kwargs["prompt_tokens"] == len(prompt)
    streamed = list(llm.stream_chat(messages))
    assert len(streamed) > 1
    assert "".join(r.delta for r in streamed) == streamed[-1].message.content
    assert streamed[-1].message.content == reply.message.content
    assert [r.text for r in llm.stream_complete("the cat")][-1] == llm.complete("the cat").text


async def test_async_methods_match_sync_and_run_together(llm):
    messages = [ChatMessage(role="user", content="hello there")]
    reply, completion = await asyncio.gather(llm.achat(messages), llm.acomplete("the cat"))
    assert reply.message.content == llm.chat(messages).message.content
    assert completion.text == llm.complete("the cat").text
    pieces = [r.delta async for r in await llm.astream_complete("the cat")]
    assert len(pieces) > 1 and "".join(pieces) == completion.text
    chat_pieces = [r.delta async for r in await llm.astream_chat(messages)]
    assert "".join(chat_pieces) == reply.message.content


def test_metadata_comes_from_the_model(llm, tiny_model_dir):
    meta = llm.metadata
    assert meta.context_window == load_model(tiny_model_dir).model.config.max_position_embeddings
    assert meta.is_chat_model and meta.num_output == 24


def test_retriever_returns_scored_nodes():
    nodes = RagSpecRetriever(HashRetriever(), similarity_top_k=2).retrieve("alpha beta")
    assert len(nodes) == 2
    assert nodes[0].score >= nodes[1].score
    assert nodes[0].node.metadata["title"].startswith("doc")


@pytest.mark.e2e
@pytest.mark.usefixtures("user_cache")
def test_query_engine_answers_from_the_default_knowledge_base():
    engine = RetrieverQueryEngine.from_args(RagSpecRetriever(similarity_top_k=2),
                                            llm=LookaheadLLM(max_new_tokens=48))
    response = engine.query("How do I join two path components with os.path?")
    assert "posixpath.join" in [n.node.metadata["title"] for n in response.source_nodes]
    assert "join" in str(response).lower()


@pytest.mark.e2e
@pytest.mark.usefixtures("user_cache")
def test_vector_store_index_works_offline_with_our_embeddings():
    docs = [Document(text="The capital of France is Paris."),
            Document(text="Python lists are mutable sequences."),
            Document(text="The mitochondria is the powerhouse of the cell.")]
    index = VectorStoreIndex.from_documents(docs, embed_model=RagSpecEmbedding())
    nodes = index.as_retriever(similarity_top_k=1).retrieve("Which city is France's capital?")
    assert "Paris" in nodes[0].node.get_content()
    engine = index.as_query_engine(llm=LookaheadLLM(max_new_tokens=24), similarity_top_k=1)
    assert str(engine.query("What is the capital of France?")).strip()


def test_an_empty_knowledge_base_is_searched_not_swapped_for_the_default():
    class Empty(HashRetriever):
        def __len__(self):  # falsy, as an empty KnowledgeBase is
            return 0

    source = Empty()
    assert RagSpecRetriever(source).backend().retriever is source


def test_metadata_names_the_fix_when_the_window_is_unknown(llm, tiny_model_dir, monkeypatch):
    import rag_spec.serving.local_lm as local_lm
    from rag_spec.errors import RagSpecError

    assert LookaheadLLM(model=tiny_model_dir, context_window=99).metadata.context_window == 99
    monkeypatch.setattr(local_lm, "context_window", lambda config, tokenizer: None)
    with pytest.raises(RagSpecError, match="context_window="):
        _ = llm.metadata


def test_a_draft_model_leaves_the_answer_unchanged(tiny_model_dir):
    plain = LookaheadLLM(model=tiny_model_dir, max_new_tokens=24).complete("the cat sat")
    drafted = LookaheadLLM(model=tiny_model_dir, max_new_tokens=24,
                           draft_model="early-exit:1").complete("the cat sat")
    assert drafted.text == plain.text


WORD_DOCS = ["alpha beta gamma.", "delta omega sigma.", "kappa theta alpha.", "beta beta delta.",
             "sigma kappa omega.", "gamma gamma theta."]


@pytest.fixture(scope="module")
def index():
    return VectorStoreIndex.from_documents([Document(text=t) for t in WORD_DOCS],
                                           embed_model=RagSpecEmbedding())


def test_an_index_behind_spec_retriever_is_searched_with_prefetch_sized_calls(index):
    from llama_index.retrievers.rag_spec._sources import LlamaIndexSource

    from rag_spec.retrieval.scoring import VectorScorer
    from rag_spec.retrieval.spec_retriever import SpecRetriever as SpeculativeSearch

    retriever = RagSpecRetriever(index, similarity_top_k=2)
    nodes = retriever.retrieve("alpha beta gamma")
    assert len(nodes) == 2 and nodes[0].node.get_content() == "alpha beta gamma."
    source = retriever.backend().retriever
    assert isinstance(source, LlamaIndexSource)
    hits = source.search(["alpha", "omega", "theta"], k=5)  # as many as prefetching asks for
    assert [len(h) for h in hits] == [5, 5, 5]
    assert [[h.doc_id for h in row] for row in hits] == \
        [[h.doc_id for h in row] for row in source.search(["alpha", "omega", "theta"], k=5)]
    assert isinstance(SpeculativeSearch(source).scorer, VectorScorer)  # guesses stay local


def test_speculative_ralm_over_an_index_equals_the_naive_loop(index):
    from conftest import char_lm
    from rag_spec.bench.simulated import DelayedRetriever
    from rag_spec.retrieval.spec_retriever import SpecRetriever as SpeculativeSearch
    from rag_spec.serving.ralm import IterativeRaLM, RaLMSpeculation

    lm = char_lm(window=1024)
    source = RagSpecRetriever(index).backend().retriever
    question = "which word comes after alpha beta?"
    expected = IterativeRaLM(lm, source, stride=2, query_tokens=12).generate(question, 30)
    spec = IterativeRaLM(lm, SpeculativeSearch(DelayedRetriever(source, 5)), stride=2,
                         query_tokens=12, speculation=RaLMSpeculation(os3=False, stride=3))
    result = spec.generate(question, 30)
    assert result.token_ids == expected.token_ids
    assert result.stats.kb_calls < expected.stats.kb_calls


def test_something_else_is_refused_with_the_fix():
    from rag_spec.errors import RagSpecError

    with pytest.raises(RagSpecError, match="LlamaIndex index or retriever"):
        RagSpecRetriever(3).retrieve("alpha")


def test_the_retrievers_first_name_still_works_and_says_it_does_not_speculate():
    from llama_index.retrievers.rag_spec import SpecRetriever

    with pytest.warns(DeprecationWarning, match="RagSpecRetriever"):
        retriever = SpecRetriever(HashRetriever(), similarity_top_k=2)
    assert isinstance(retriever, RagSpecRetriever)
    assert len(retriever.retrieve("alpha beta")) == 2


def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


def multiply(a: int, b: int) -> int:
    """Multiply two integers and return the product."""
    return a * b


@pytest.mark.e2e
@pytest.mark.usefixtures("user_cache")
async def test_a_function_agent_completes_a_two_tool_task_on_the_embedded_model():
    from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult

    agent = FunctionAgent(tools=[add, multiply], llm=LookaheadLLM(max_new_tokens=96),
                          initial_tool_choice="required", allow_parallel_tool_calls=True,
                          system_prompt="Compute with the tools: add and multiply.")
    handler = agent.run("Call add with a=3, b=4 and call multiply with a=5, b=6.",
                        max_iterations=4)
    calls = [(event.tool_name, event.tool_kwargs, event.tool_output.raw_output)
             async for event in handler.stream_events() if isinstance(event, ToolCallResult)]
    answer = str(await handler)
    # both calls in the first step (forced, parallel), then an answer from their results
    # (the 135M model says them in the results' own format, tags included)
    assert calls == [("add", {"a": 3, "b": 4}, 7), ("multiply", {"a": 5, "b": 6}, 30)]
    assert "7" in answer and "30" in answer


def test_why_an_answer_ended_is_in_raw_and_additional_kwargs(llm):
    for response in (llm.complete("the cat sat"),
                     llm.chat([ChatMessage(role="user", content="hello there")]),
                     list(llm.stream_complete("the cat sat"))[-1]):
        assert response.raw["finish_reason"] == "length"  # the OpenAI API's words
        assert response.additional_kwargs["ended_by"] == "length"  # the decoder's
