# %% [markdown]
# # Iterative RaLM: naive vs speculative retrieval
#
# In-Context RaLM retrieves again every few generated tokens: the latest 32 tokens query the
# knowledge base and the top passage replaces the one in the prompt. Each retrieval blocks
# generation. RaLMSpec guesses each retrieval from a small per-request cache, keeps generating,
# and checks a batch of guesses with one knowledge-base call (on a worker thread, while the
# next tokens generate). A wrong guess rolls back to where it was made. The tokens are those
# of the naive loop; only the waiting goes.
#
# To see the effect on a laptop-sized corpus, we put the knowledge base behind a simulated
# 150 ms service delay per call, as a remote vector store or search server would have.

# %%
import matplotlib.pyplot as plt

import rag_spec
from rag_spec import DelayedRetriever

lm = rag_spec.load_model()
kb = DelayedRetriever(rag_spec.KnowledgeBase.load_default("bm25"), latency_ms=150)
question = "How do I read rows from a CSV file and write them back?"

naive = rag_spec.IterativeRaLM(lm, kb, stride=4, query_tokens=32, k=1)
speculative = rag_spec.IterativeRaLM(lm, rag_spec.SpecRetriever(kb), stride=4,
                                     query_tokens=32, k=1)
_ = naive.generate("warm up", max_new_tokens=8)  # loads the model and index once

# %%
import time

results = {}
for name, loop in (("naive", naive), ("speculative", speculative)):
    started = time.perf_counter()
    results[name] = (loop.generate(question, max_new_tokens=64), time.perf_counter() - started)
    out, seconds = results[name]
    print(f"{name:12} {seconds:5.2f} s, {out.stats.kb_calls:2d} knowledge-base calls, "
          f"{out.stats.rollbacks} rollbacks, {out.stats.retrieval_seconds:.2f} s in retrieval")

assert results["naive"][0].token_ids == results["speculative"][0].token_ids
print("\nidentical tokens:", results["speculative"][0].text[:200], "...")

# %% [markdown]
# ## The stride OS3 chose, and the rollbacks
#
# OS3 picks how many retrievals to guess before verifying, from the measured cost of a guess,
# of a verification and the recent hit rate. Each bar is one speculation round (its stride);
# red lines mark the output positions where a guess was wrong and generation rolled back.

# %%
stats = results["speculative"][0].stats
fig, ax = plt.subplots(figsize=(8, 3))
ax.bar(range(len(stats.strides)), stats.strides, color="tab:blue", label="speculation stride")
ax.set_xlabel("speculation round")
ax.set_ylabel("retrievals guessed")
top = ax.twiny()
top.set_xlim(0, len(results["speculative"][0].token_ids))
for point in stats.rollback_points:
    top.axvline(point, color="tab:red", lw=1.5)
top.set_xlabel("output token position (red: rollback)")
ax.legend(loc="upper left")
plt.tight_layout()
plt.show()

# %% [markdown]
# ## Why OS3 chose stride 1 here
#
# Behind a 150 ms service a verification takes less time than generating a 4-token stride, so
# OS3 verifies each guess as soon as it is made: the call runs on the worker while the next
# stride generates, and generation hardly ever waits for it. Longer strides pay where a call
# costs more than a stride (an exact search over millions of vectors, see the benchmarks). The
# loop keeps what OS3 measured for its next question, so keep one `IterativeRaLM` for your
# application.

# %%
second = speculative.generate("How do I compress a file with gzip?", max_new_tokens=64)
for name, s in (("first", stats), ("second", second.stats)):
    print(f"{name:6} question: strides {s.strides[:6]}..., {s.retrieval_seconds:.2f} s in "
          f"knowledge-base calls, {s.waiting_seconds:.2f} s of it waited for")
