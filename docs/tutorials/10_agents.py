# %% [markdown]
# # An agent on a local model, with a retriever tool
#
# Agentic RAG makes retrieval one of the tools an agent calls: the model reads the question,
# calls a documentation search, reads what came back and answers. This notebook builds such an
# agent with LangChain's `create_agent` (LangGraph runs it) on `ChatLookahead` and the
# embedded 135M model, entirely offline.
#
# Two things make a small model a workable agent here:
#
# - every call is decoded under a grammar of the tool's JSON schema, so it always parses and
#   its arguments follow the schema (bound the strings: `max_length`);
# - `tools_first()` makes the model call a tool on the turn that answers the person; left to
#   choose (`tool_choice="auto"`), a 135M model answers most questions itself.
#
# Install: `pip install './integrations/langchain-rag-spec[agents]'` (`make` does).

# %%
from typing import Annotated

from langchain.agents import create_agent
from langchain_core.tools import tool
from pydantic import Field

from langchain_rag_spec import ChatLookahead, SpecRetriever, tools_first

retriever = SpecRetriever(k=2)  # the default knowledge base: the standard library's docs


@tool
def search_python_docs(query: Annotated[str, Field(max_length=40)]) -> str:
    """Search the Python standard library's documentation."""
    return "\n\n".join(d.page_content for d in retriever.invoke(query))


@tool
def word_count(text: Annotated[str, Field(max_length=60)]) -> int:
    """Count the words in a text."""
    return len(text.split())


agent = create_agent(ChatLookahead(max_tokens=128), [search_python_docs, word_count],
                     middleware=[tools_first()])

# %% [markdown]
# ## One task, message by message
#
# The model calls a tool (its call carries an id), the tool's result comes back as a
# `ToolMessage` under that id, and the model answers. Each model turn reports how it was
# decoded: tokens per forward pass (above 1: drafts were accepted), the share of the turn
# spent reading the prompt (prefill), and how many of the prompt's tokens it read as an earlier
# turn computed them instead of computing them again: on the embedded model's GGUF weights a
# token's entries are the same in any pass, so a later turn computes only what the
# conversation added (the call and the tool's result), with the same tokens. Which tool
# the model picks, and what it makes of the result, are the 135M model's own: a larger local
# model (`ChatLookahead(model="path/to/folder")`) answers better through the same loop.

# %%
result = agent.invoke({"messages": [("user", "How do I join two path components?")]})
for message in result["messages"]:
    line = f"{message.type:>5}: {message.content[:100]!r}"
    for call in getattr(message, "tool_calls", []):
        line += f"\n       call {call['name']}({call['args']}) id={call['id']}"
    if message.type == "tool":
        line += f"\n       answers {message.tool_call_id}"
    spec = message.response_metadata.get("speculation")
    if spec:
        line += (f"\n       {spec['tokens_per_step']:.2f} tokens per pass, "
                 f"prefill {spec['prefill_share']:.0%} of the turn, "
                 f"{spec['cached_prompt_tokens']} of {message.usage_metadata['input_tokens']} "
                 f"prompt tokens read")
    print(line)

# %% [markdown]
# ## Streaming the agent's steps
#
# `stream_mode="updates"` yields each node's output as it finishes (the model, the tools);
# `stream_mode="messages"` yields the model's messages as chunks.

# %%
for update in agent.stream({"messages": [("user", "Count the words in 'to be or not to be'.")]},
                           stream_mode="updates"):
    for node, state in update.items():
        last = state["messages"][-1]
        print(f"{node}: {last.type} {last.content[:60]!r} {getattr(last, 'tool_calls', '')}")

# %% [markdown]
# ## What it costs, and what it equals
#
# `rag-spec bench agent` runs the same agent on `ChatLookahead`, on it without drafts, and on
# transformers `generate` under xgrammar's logits processor (what a local agent runs without
# rag-spec: `ChatHuggingFace` over a local pipeline makes no tool calls), task by task, and
# checks that every transcript is the same. LangGraph's prebuilt `create_react_agent` works
# too: give it a function of the state that returns
# `chat.bind_tools(tools, tool_choice="any")` on the person's turn and
# `chat.bind_tools(tools)` after.
