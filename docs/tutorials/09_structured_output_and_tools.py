# %% [markdown]
# # Structured output and tool calls, speculated
#
# A JSON schema forces many tokens (keys, quotes, braces), and a grammar can check every
# drafted token before a forward pass pays for it. This notebook extracts a JSON record from
# retrieved passages with `LookaheadDecoder.generate(json_schema=...)`, checks the tokens are
# those of constrained greedy decoding (transformers `generate` under xgrammar's logits
# processor), then lets LangChain's `ChatLookahead` and LlamaIndex's `LookaheadLLM` call the
# knowledge base as a tool.

# %%
import time

import torch
import xgrammar as xgr
from pydantic import BaseModel, Field

import rag_spec
from rag_spec import chat_input_ids

lm = rag_spec.load_model()
kb = rag_spec.KnowledgeBase.load_default("flat")


class Api(BaseModel):
    """The API a question is about."""

    name: str = Field(description="the dotted name", max_length=60)
    module: str = Field(max_length=40)
    summary: str = Field(description="one sentence", max_length=160)


question = "How do I parse a JSON string into a Python object?"
hits = kb.search([question], k=2)[0]
passages = "\n\n".join(f"{h.title}: {h.text}" for h in hits)
prompt = chat_input_ids(lm.tokenizer, [{"role": "user", "content": (
    f"Passages:\n{passages}\n\nQuestion: {question}\nGive the API as JSON.")}])

# %% [markdown]
# ## Extraction under a schema
#
# Every output parses: the grammar masks each drafted node's logits along its own path, cuts
# drafts it forbids, and drafts what it forces (a key, a closing quote) as a chain. The JSON
# allows at most one whitespace character at each place by default (any more, and a small
# model spends its tokens on newlines; none, and it writes strings it never closes);
# `rag_spec.JsonSchema(Api, indent=2)` lays it out over lines. The decoder runs the float32
# weights (`quantized=False`), as the peer below does, so the tokens can be compared; by default
# it would decode the embedded model's GGUF weights, another model's tokens.

# %%
decoder = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer,
                                    rag_spec.LookaheadConfig(quantized=False))
started = time.perf_counter()
result = decoder.generate(prompt, max_new_tokens=160, json_schema=Api)
ours = time.perf_counter() - started
record = Api.model_validate_json(result.text)
print(record)
print(f"{result.stats.tokens_per_step:.2f} tokens per forward pass")

# %% [markdown]
# ## The same tokens as constrained greedy decoding
#
# The peer decodes under the same grammar: at most one whitespace character a place.

# %%
info = xgr.TokenizerInfo.from_huggingface(
    lm.tokenizer, vocab_size=lm.model.get_input_embeddings().num_embeddings)
compiled = xgr.GrammarCompiler(info).compile_json_schema(Api, max_whitespace_cnt=1)
ids = torch.tensor([prompt])
started = time.perf_counter()
out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                        max_new_tokens=160,
                        logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
peer = time.perf_counter() - started
expected = out[0, len(prompt):].tolist()
assert result.token_ids == expected[:len(result.token_ids)]
print(f"identical; generate + xgrammar {peer:.1f} s, ours {ours:.1f} s "
      f"({peer / ours:.2f}x, one prompt: `rag-spec bench structured` measures properly)")

# %% [markdown]
# ## LangChain: the knowledge base as a tool
#
# `bind_tools` offers the tools through the chat template, and the model calls them in its
# family's own format, read from the template (Qwen's `<tool_call>` blocks, Llama 3.x's bare
# JSON, Mistral's `[TOOL_CALLS]`); SmolLM2's template has no tools section, so a system
# message teaches it the `<tool_call>` format. The call is decoded under a grammar of the
# tools' schemas, so it always parses into `AIMessage.tool_calls`.

# %%
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

from langchain_rag_spec import ChatLookahead  # noqa: E402


@tool
def search_docs(query: str) -> str:
    """Search the Python standard library's documentation."""
    return "\n".join(f"{h.title}: {h.text[:200]}" for h in kb.search([query], k=1)[0])


chat = ChatLookahead(max_tokens=96).bind_tools([search_docs], tool_choice="any")
question = HumanMessage("How do I copy a whole directory tree?")
call_message = chat.invoke([question])
print(call_message.tool_calls)
results = [ToolMessage(search_docs.invoke(c["args"]), tool_call_id=c["id"])
           for c in call_message.tool_calls]
answer = ChatLookahead(max_tokens=96).invoke([question, call_message, *results])
print(answer.content)

# %% [markdown]
# ## LlamaIndex: a function-calling LLM
#
# `LookaheadLLM` is a `FunctionCallingLLM`: `predict_and_call` (and agents such as
# `FunctionAgent`) run on it; `structured_predict` goes through a forced call.

# %%
from llama_index.core.tools import FunctionTool  # noqa: E402
from llama_index.llms.rag_spec import LookaheadLLM  # noqa: E402

llm = LookaheadLLM(max_new_tokens=96)
docs_tool = FunctionTool.from_defaults(fn=search_docs.func, name="search_docs")
output = llm.predict_and_call([docs_tool], user_msg="Find how to join paths.",
                              tool_required=True)
print(output.sources[0].tool_name, output.sources[0].raw_input)
print(str(output)[:300])

# %% [markdown]
# `structured_predict` forces a call whose arguments follow the output class's schema:

# %%
from llama_index.core import PromptTemplate  # noqa: E402

extractor = LookaheadLLM(max_new_tokens=160)
api = extractor.structured_predict(Api, PromptTemplate(
    "Passages:\n{passages}\n\nWhich API parses a JSON string into a Python object?"),
    passages=passages)
print(api)

# %% [markdown]
# An agent: LlamaIndex's `FunctionAgent` runs on it. Its first step must call a tool
# (`initial_tool_choice`); the next one answers from the result (or calls again). The
# template of SmolLM2 has no tools section, so results come back as
# `<tool_response>name: result</tool_response>` in the user's turn.

# %%
from llama_index.core.agent.workflow import FunctionAgent, ToolCallResult  # noqa: E402

agent = FunctionAgent(tools=[docs_tool], llm=llm, initial_tool_choice="search_docs",
                      system_prompt="Answer questions about Python from its documentation.")
handler = agent.run("How do I copy a whole directory tree?", max_iterations=6)
async for event in handler.stream_events():
    if isinstance(event, ToolCallResult):
        print("called", event.tool_name, event.tool_kwargs)
print(str(await handler)[:300])
