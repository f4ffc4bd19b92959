"""Agents on the embedded model: LangChain's ``create_agent`` and LangGraph's prebuilt ReAct
agent run their tool loops on ``ChatLookahead``, with a retriever tool over a SpecRetriever
and a word count. Assertions are on the protocol (every call has an id, its arguments follow
the tool's schema, the tool's result answers that id, the loop ends with an answer), not on
the 135M model's wisdom; and the transcript is the one transformers ``generate`` writes under
xgrammar's logits processor on the same prompts and grammars."""

import warnings

import pytest
from langchain_core.messages import AIMessage, AIMessageChunk, ToolMessage

from rag_spec.bench.prompts import HELD_OUT_RAG_QUESTIONS

pytest.importorskip("langchain.agents")
from langchain.agents import create_agent  # noqa: E402

from langchain_rag_spec import ChatLookahead, SpecRetriever, tools_first  # noqa: E402
from rag_spec_chain_bench.agent import (  # noqa: E402
    COUNTING,
    GenerateChat,
    agent_tools,
    transcript,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.usefixtures("user_cache")]

TASKS = [HELD_OUT_RAG_QUESTIONS[0], HELD_OUT_RAG_QUESTIONS[3], COUNTING[1]]
MAX = 128


@pytest.fixture(scope="module")
def tools():
    return agent_tools(SpecRetriever(k=2))


def follows_the_protocol(messages, tools):
    """Every call: an id, a bound tool's name, arguments its schema takes, answered by the
    next messages' results under the same ids; the last message an answer, no call."""
    by_name = {t.name: t for t in tools}
    assert messages[0].type == "human"
    calls = 0
    for at, message in enumerate(messages):
        if not isinstance(message, AIMessage) or not message.tool_calls:
            continue
        assert not message.invalid_tool_calls
        results = messages[at + 1:at + 1 + len(message.tool_calls)]
        for call, result in zip(message.tool_calls, results, strict=True):
            assert call["id"] and call["name"] in by_name
            by_name[call["name"]].args_schema.model_validate(call["args"])  # raises if not
            assert isinstance(result, ToolMessage) and result.tool_call_id == call["id"]
            assert result.name == call["name"] and result.status == "success"
            calls += 1
    assert isinstance(messages[-1], AIMessage) and not messages[-1].tool_calls
    return calls


def test_create_agent_runs_its_tool_loop_and_writes_generates_transcript(tools):
    # on the peer's weights (float32, not the GGUF file's): its transcript is ours to equal
    chat = ChatLookahead(max_tokens=MAX, lookahead={"quantized": False})
    agent = create_agent(chat, tools, middleware=[tools_first()])
    peer = create_agent(GenerateChat(lm=chat.local_lm(), max_tokens=MAX), tools,
                        middleware=[tools_first()])
    for task in TASKS:
        messages = agent.invoke({"messages": [("user", task)]})["messages"]
        assert follows_the_protocol(messages, tools) >= 1  # the first turn called a tool
        assert transcript(messages) == transcript(
            peer.invoke({"messages": [("user", task)]})["messages"])
        counts = [(call["args"]["text"], result.content) for call, result in
                  zip(messages[1].tool_calls, messages[2:]) if call["name"] == "word_count"]
        assert all(result == str(len(text.split())) for text, result in counts)


def test_the_agents_steps_stream_as_updates_and_as_message_chunks(tools):
    agent = create_agent(ChatLookahead(max_tokens=MAX), tools, middleware=[tools_first()])
    request = {"messages": [("user", TASKS[1])]}
    nodes = [node for update in agent.stream(request, stream_mode="updates")
             for node in update]
    assert nodes.count("model") >= 2 and "tools" in nodes  # model, tools, model
    chunks = [chunk for chunk, _ in agent.stream(request, stream_mode="messages")]
    called = [c for c in chunks if isinstance(c, AIMessageChunk) and c.tool_calls]
    assert called and called[0].tool_calls[0]["name"] in {t.name for t in tools}
    assert any(isinstance(c, ToolMessage) for c in chunks)


def test_langgraphs_prebuilt_agent_runs_the_same_loop(tools):
    """``create_react_agent`` (LangGraph's; LangChain 1.x's ``create_agent`` replaces it)
    with a model chosen per step: the tools forced on the turn that answers the person."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation in favour of create_agent
        from langgraph.prebuilt import create_react_agent

    chat = ChatLookahead(max_tokens=MAX)

    def model(state, runtime):
        forced = state["messages"][-1].type == "human"
        return chat.bind_tools(tools, tool_choice="any" if forced else "auto")

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = create_react_agent(model, tools)
    messages = agent.invoke({"messages": [("user", TASKS[0])]})["messages"]
    assert follows_the_protocol(messages, tools) >= 1
    first = create_agent(chat, tools, middleware=[tools_first()])
    assert transcript(messages) == transcript(
        first.invoke({"messages": [("user", TASKS[0])]})["messages"])
