# %% [markdown]
# # LlamaIndex: a query engine with `LookaheadLLM`
#
# A `VectorStoreIndex` over a few standard-library modules, embedded offline with
# `RagSpecEmbedding`, answering through `LookaheadLLM`. We stream an answer, then look under
# the hood: how many drafted tokens each forward pass confirmed.

# %%
import collections

import matplotlib.pyplot as plt
from llama_index.core import Document, VectorStoreIndex
from llama_index.embeddings.rag_spec import RagSpecEmbedding
from llama_index.llms.rag_spec import LookaheadLLM

from rag_spec import load_passages

MODULES = ("json", "csv", "shutil", "posixpath", "datetime", "collections")
documents = [Document(text=p.text, metadata={"title": p.title})
             for p in load_passages() if p.title.split(".")[0] in MODULES]
index = VectorStoreIndex.from_documents(documents, embed_model=RagSpecEmbedding())
llm = LookaheadLLM(max_new_tokens=96)
engine = index.as_query_engine(llm=llm, similarity_top_k=3, streaming=True)
print(f"{len(documents)} documents indexed; context window {llm.metadata.context_window}")

# %% [markdown]
# ## Stream an answer
#
# Pieces arrive as the decoder accepts them, often several tokens at a time.

# %%
response = engine.query("How do I count how often each item occurs in a list?")
pieces = []
for piece in response.response_gen:
    pieces.append(piece)
    print(piece, end="", flush=True)
print(f"\n\n{len(pieces)} streamed pieces; sources:",
      [n.node.metadata["title"] for n in response.source_nodes])

# %% [markdown]
# ## Accepted tokens per forward pass
#
# Each response carries the decoder's statistics in `additional_kwargs`. A step that accepts
# k drafted tokens commits k + 1 tokens (the model's own next token comes free).

# %%
retriever = index.as_retriever(similarity_top_k=3)
accepted = collections.Counter()
for question in ["How do I parse a JSON string?", "How do I read rows from a CSV file?",
                 "How do I get the current date and time?", "How do I copy a directory tree?"]:
    context = "\n\n".join(n.node.get_content() for n in retriever.retrieve(question))
    reply = llm.complete(f"{context}\n\nQuestion: {question}\nAnswer:")
    accepted.update(reply.additional_kwargs["accepted_per_step"])
    print(f"{question}: {reply.additional_kwargs['tokens_per_step']:.2f} tokens per step")

fig, ax = plt.subplots(figsize=(6, 3))
ax.bar(list(accepted), list(accepted.values()))
ax.set_xlabel("drafted tokens accepted in one forward pass")
ax.set_ylabel("steps")
plt.tight_layout()
plt.show()
