# %% [markdown]
# # kNN-LM over your documents, speculated
#
# A kNN-LM (Khandelwal et al., 2020) keeps the model's hidden state at every position of a
# corpus, with the token that came next. At each generated token it searches that datastore
# for the `k` nearest states and lets their next tokens vote:
# `p = lambda * p_kNN + (1 - lambda) * p_LM`. The model then continues the way your documents
# do, but a datastore search per token dominates the cost.
#
# Speculative kNN-LM (RaLMSpec) guesses each step's neighbours from a small cache: the entries
# that follow the last verified neighbours, since the datastore is in corpus order. It decodes
# a stride on those guesses and checks the whole stride with one batched search; at the first
# step whose token the true neighbours would not have chosen, it rolls back. The output is the
# naive loop's, token for token.

# %%
import tempfile
import time
from pathlib import Path

import rag_spec
from rag_spec import load_passages

MODULES = ("csv", "gzip", "json", "shutil", "zipfile")
folder = Path(tempfile.mkdtemp()) / "docs"
folder.mkdir()
for module in MODULES:  # a folder of text files, as your own documents would be
    texts = [f"{p.title}\n{p.text}" for p in load_passages() if p.title.split(".")[0] == module]
    (folder / f"{module}.txt").write_text("\n\n".join(texts))
print(sorted(f.name for f in folder.iterdir()))

# %% [markdown]
# ## Build the datastore
#
# `KNNDatastore.open` runs the model over every passage once (a progress bar shows it) and
# saves keys and next tokens under the cache; opening it again checks that it was built from
# these passages, with this model and this key. The key is the input of the last layer's
# feed-forward block (`key="final"` takes the final norm's output instead).

# %%
lm = rag_spec.load_model()
store = rag_spec.KNNDatastore.open(lm, [str(folder)])
print(f"{len(store):,} entries of {store.dim} dimensions, {store.nbytes / 1e6:.0f} MB")

# %% [markdown]
# ## Naive and speculative kNN-LM
#
# The same model, datastore and settings; `speculation=None` is the naive loop, a search per
# token. Prompts open a passage of the folder, so the datastore holds text to follow.

# %%
naive = rag_spec.KNNLM(lm, store, k=16, speculation=None)
spec = rag_spec.KNNLM(lm, store, k=16)  # KNNSpeculation(): OS3 strides, 8 successors cached
prompt = "json.dumps\nSerialize ``obj`` to a JSON formatted"
a = naive.generate(prompt, max_new_tokens=48)
b = spec.generate(prompt, max_new_tokens=48)
print(repr(b.text))
print("identical:", a.token_ids == b.token_ids)
print(f"datastore searches: naive {a.stats.kb_calls}, speculative {b.stats.kb_calls} "
      f"({b.stats.rollbacks} rollbacks)")

# %% [markdown]
# Here a search takes a millisecond, so OS3 verifies every step (stride 1): a guess saves
# nothing when asking the datastore costs no more.
#
# ## When the datastore is large
#
# A real datastore holds millions of entries, and each exact search reads all of them. We pad
# ours with random distractor entries to 400,000 (as `rag-spec bench knnlm` does, which
# measures many prompts, interleaved). As an application would, we keep one `KNNLM` and let
# a first request teach OS3 the search and step latencies, then time a second one.

# %%
large = store.with_distractors(400_000)
naive = rag_spec.KNNLM(lm, large, k=16, speculation=None)
spec = rag_spec.KNNLM(lm, large, k=16)
spec.generate("json.loads\nDeserialize", max_new_tokens=32)  # OS3 learns the latencies
for name, knn in (("naive", naive), ("speculative", spec)):
    started = time.perf_counter()
    out = knn.generate(prompt, max_new_tokens=48)
    seconds = time.perf_counter() - started
    print(f"{name:12} {seconds:5.2f} s  searches {out.stats.kb_calls:3}  "
          f"search time {out.stats.retrieval_seconds:5.2f} s")

# %% [markdown]
# Sampling works the same way: each position draws with its own seeded uniform, so the
# speculative loop samples exactly the naive loop's tokens.

# %%
a = naive.generate(prompt, max_new_tokens=24, do_sample=True, seed=7)
b = spec.generate(prompt, max_new_tokens=24, do_sample=True, seed=7)
print(repr(b.text), "identical:", a.token_ids == b.token_ids)

# %% [markdown]
# `KNNLM(k=..., lambda_=..., temperature=...)` set the interpolation; `KNNSpeculation(
# successors=..., capacity=..., os3=..., stride=...)` the speculation. `KNNDatastore` also
# comes as IVF-PQ (`kind="ivfpq"`, 64-byte codes) and with float16 keys
# (`precision="float16"`, half the memory).
