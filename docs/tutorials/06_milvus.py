# %% [markdown]
# # A knowledge base in Milvus, speculated
#
# When a corpus outgrows one machine it lives in a vector database, and every retrieval is a
# network round trip: exactly where speculative retrieval pays most. rag-spec speaks to Milvus
# through one client for both ends:
#
# - **milvus-lite**, a local folder, no server to install: rag-spec starts it in its own process
#   on a loopback port (so a search is a real round trip, and its searches never compete with
#   the model for OpenMP threads);
# - a **Milvus server or cluster**, given as `http(s)://host:port` (and a token): the same code.
#
# We index a folder into milvus-lite, then answer with the naive iterative RaLM loop and the
# speculative one. Install with `pip install 'rag-spec[milvus]'` (`make` does).

# %%
import tempfile
from pathlib import Path

import rag_spec
from rag_spec import load_passages

MODULES = ("csv", "gzip", "json", "shutil", "zipfile")
workdir = Path(tempfile.mkdtemp())
folder = workdir / "docs"
folder.mkdir()
for module in MODULES:  # a folder of text files, as your own documents would be
    texts = [f"{p.title}\n{p.text}" for p in load_passages() if p.title.split(".")[0] == module]
    (folder / f"{module}.txt").write_text("\n\n".join(texts))
print(sorted(f.name for f in folder.iterdir()))

# %% [markdown]
# ## Build the collection
#
# `MilvusKnowledgeBase.open` embeds the passages with the bundled MiniLM, inserts them in
# batches (a progress bar shows them), builds an HNSW index and points the alias
# `rag_spec_<corpus>` at the new collection. Opening it again finds it and checks that it was
# built from these passages with this embedder. A rebuild (`rebuild=True`, or
# `rag-spec index build --backend milvus --rebuild`) fills a new collection and switches the
# alias only when it is complete: an interrupted build never serves.

# %%
kb = rag_spec.MilvusKnowledgeBase.open([str(folder)], uri=str(workdir / "milvus.db"))
print(f"{len(kb)} passages in {kb.alias}")
hits = kb.search(["read rows from a CSV file", "compress with gzip"], k=2)  # one request
for row in hits:
    print([h.title for h in row], "vector:", row[0].vector.shape)

# %% [markdown]
# Each hit carries its vector. That is what lets `SpecRetriever` score its guesses here, with
# no call to Milvus per guess: the query is embedded locally and compared with the cached
# passages' vectors, the metric Milvus itself ranks by. A retriever that returns no vectors
# (your own client) works too: the cached passages' texts are then embedded here, once each.
#
# ## Naive vs speculative RaLM
#
# The loop retrieves every 4 tokens. milvus-lite on loopback answers in a few milliseconds;
# a cluster across a network takes tens to hundreds, so we add 50 ms per call.

# %%
import time

from rag_spec import DelayedRetriever

lm = rag_spec.load_model()
remote = DelayedRetriever(kb, latency_ms=50)
naive = rag_spec.IterativeRaLM(lm, remote, stride=4)
speculative = rag_spec.IterativeRaLM(lm, rag_spec.SpecRetriever(remote), stride=4)
_ = naive.generate("warm up", max_new_tokens=4)

question = "How do I read rows from a CSV file and compress the result with gzip?"
results = {}
for name, loop in (("naive", naive), ("speculative", speculative)):
    started = time.perf_counter()
    out = loop.generate(question, max_new_tokens=48)
    results[name] = out
    print(f"{name:12} {time.perf_counter() - started:5.2f} s, {out.stats.kb_calls:2d} Milvus "
          f"calls, {out.stats.rollbacks} rollbacks, {out.stats.retrieval_seconds:.2f} s in "
          f"retrieval")
assert results["naive"].token_ids == results["speculative"].token_ids
print("\nidentical answers:", results["speculative"].text[:160], "...")

# %% [markdown]
# ## The same code on a Milvus cluster
#
# Point `uri` at the server and give its token; nothing else changes:
#
# ```python
# kb = rag_spec.MilvusKnowledgeBase.open(["/data/handbook"], uri="https://milvus.internal:19530",
#                                        token="user:password", timeout=5)
# ```
#
# or on the command line: `rag-spec index build --backend milvus --uri https://... --source
# /data/handbook`, then `rag-spec ask --backend milvus --uri https://... "question"`.
# Every request has a deadline (`timeout`, 10 s by default): a server that stops answering is a
# clear error naming the URI, never a hang, and the loop works again once the server is back.
# See *Milvus* in the configuration reference for the details.
