# %% [markdown]
# # Any OpenAI client: `rag-spec serve`
#
# Most code reaches a local model through the OpenAI API: LangChain's `ChatOpenAI`,
# LlamaIndex's `OpenAILike`, the `openai` SDK, other languages, curl. `rag-spec serve` speaks
# that API and decodes speculatively behind it, so those clients get the same answers sooner
# without importing rag-spec.
#
# From a shell: `rag-spec serve --port 8000` (`pip install '.[serve]'`). Here the server runs
# inside the notebook (`rag_spec.Server`, on 127.0.0.1 and a free port) and stops at the end.

# %%
import openai
from langchain_openai import ChatOpenAI
from llama_index.core.llms import ChatMessage
from llama_index.llms.openai_like import OpenAILike

import rag_spec

server = rag_spec.Server().start()  # the embedded model, loaded before it listens
base_url = server.url + "/v1"
print("serving at", base_url)

# %% [markdown]
# ## The `openai` SDK
#
# Greedy (`temperature=0`) answers are the model's own greedy decoding. The response carries
# the speculation's statistics in an extra field, `rag_spec`, that clients ignore.

# %%
client = openai.OpenAI(base_url=base_url, api_key="unused")
reply = client.chat.completions.create(
    model="smollm2-135m-instruct", temperature=0, max_tokens=96,
    messages=[{"role": "user", "content": "How do I read a CSV file in Python?"}])
print(reply.choices[0].message.content)
stats = reply.model_extra["rag_spec"]
print(f"{stats['tokens_per_step']:.2f} tokens per forward pass, "
      f"{stats['tokens_per_second']:.0f} tokens/s")

# %% [markdown]
# Streamed, as server-sent events:

# %%
stream = client.chat.completions.create(
    model="smollm2-135m-instruct", temperature=0, max_tokens=48, stream=True,
    messages=[{"role": "user", "content": "Name three Python data types."}])
print("".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices))

# %% [markdown]
# ## LangChain and LlamaIndex, unchanged
#
# `ChatOpenAI` and `OpenAILike` pointed at the server give the answer `ChatLookahead` gives
# in-process with the same settings.

# %%
langchain_llm = ChatOpenAI(base_url=base_url, api_key="unused", model="smollm2-135m-instruct",
                           temperature=0, max_tokens=64)
print(langchain_llm.invoke("What does os.path.join do?").content)

index_llm = OpenAILike(api_base=base_url, api_key="unused", model="smollm2-135m-instruct",
                       temperature=0, max_tokens=64, is_chat_model=True)
print(index_llm.chat([ChatMessage(role="user", content="What does os.path.join do?")]))

# %% [markdown]
# ## Tools and JSON
#
# A call is decoded under a grammar of the tool's schema, so it always parses; so is an answer
# under `response_format`'s JSON schema.

# %%
weather = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather at a location.",
    "parameters": {"type": "object", "required": ["location"],
                   "properties": {"location": {"type": "string", "maxLength": 30}}}}}
called = client.chat.completions.create(
    model="smollm2-135m-instruct", temperature=0, max_tokens=64, tools=[weather],
    tool_choice="required", messages=[{"role": "user", "content": "Weather in Paris?"}])
print(called.choices[0].message.tool_calls[0].function)

server.stop()
