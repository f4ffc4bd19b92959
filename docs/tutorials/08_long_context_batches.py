# %% [markdown]
# # Long-context RAG in batches: self-speculation (MagicDec)
#
# With dozens of retrieved passages per question and many questions at once, a decoding step
# reads the KV cache far more than the weights: at batch 16 and 4k tokens of context the
# default model's cache is ~3 GB against 0.54 GB of weights. A draft model then helps little,
# since it would read its own long cache. MagicDec's answer: the model drafts for *itself*
# through a StreamingLLM view of its cache (a few "attention sink" tokens plus the most recent
# window), so a draft pass reads a few hundred KV entries per row, whatever the context.
#
# `SelfSpecDrafter` does that without a second prefill: its passes run on the target's own
# cache and are dropped before the target verifies. How many tokens it drafts per step comes
# from MagicDec's cost model, fed with the step costs it measures on your batch, and it drafts
# nothing where speculation would lose. Greedy output is the model's own, token for token.

# %%
import time

import rag_spec
from rag_spec import (
    LookaheadConfig,
    LookaheadDecoder,
    SelfSpecDrafter,
    chat_input_ids,
    rag_messages,
)

lm = rag_spec.load_model()
kb = rag_spec.KnowledgeBase.load_default("flat")

# %% [markdown]
# ## Long prompts: a question and every passage that fits
#
# Each prompt takes the top-ranked passages for its question until it reaches ~1,500 tokens,
# so the rows of the batch have different lengths (the decoder pads them and masks the padding
# out).

# %%
QUESTIONS = ["How do I parse a JSON string into a Python object?",
             "How do I read rows from a CSV file?",
             "How do I compress data with zlib?",
             "How do I copy a whole directory tree?"]
CONTEXT = 1500

prompts = []
for question, hits in zip(QUESTIONS, kb.search(QUESTIONS, k=60)):
    kept = []
    for hit in hits:
        if len(chat_input_ids(lm.tokenizer, rag_messages(question, [*kept, hit]))) > CONTEXT:
            break
        kept.append(hit)
    prompts.append(chat_input_ids(lm.tokenizer, rag_messages(question, kept)))
print("prompt lengths:", [len(p) for p in prompts])

# %% [markdown]
# ## Decode the batch without drafts, then with the self-drafter
#
# `LookaheadConfig(budget=0)` is our decoder drafting nothing: the same kernels, so the
# difference between the two runs is speculation alone. The self-drafter reads 4 sink tokens
# and the last 252 of each row (`budget=256`).

# %%
plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0))
drafter = SelfSpecDrafter(budget=256, sinks=4)
speculative = LookaheadDecoder(lm.model, lm.tokenizer, drafter=drafter)
runs = {}
for name, decoder in (("no drafts", plain), ("self-speculation", speculative)):
    started = time.perf_counter()
    results = decoder.generate(prompts, max_new_tokens=48)
    seconds = time.perf_counter() - started - results[0].stats.prefill_seconds
    runs[name] = [r.token_ids for r in results]
    tokens = sum(len(r.token_ids) for r in results)
    steps = sum(r.stats.tokens_per_step for r in results) / len(results)
    print(f"{name:>17}: {tokens / seconds:5.1f} tokens/s decoding, {steps:.2f} tokens per step")
assert runs["self-speculation"] == runs["no drafts"]  # the same tokens on every row
print(results[0].text[:300])

# %% [markdown]
# ## What the cost model saw
#
# `drafter.last` holds the batch's measurements: seconds of a target pass by width (tokens
# per row), of a draft pass, each row's estimated acceptance, and how many rounds drafted how
# many tokens (0: plain decoding). A round drafting `gamma` tokens pays when the accepted
# tokens outweigh `gamma` draft passes plus the wider verification pass.

# %%
drafter.last.as_dict()

# %% [markdown]
# On two CPU cores at batch 4 and 1.5k tokens the cache is still small next to the weights, so
# a draft pass costs most of a plain step and the cost model drafts little; the gain grows
# with batch size and context length (`rag-spec bench longctx` measures batch 1-16 at 1k-4k
# tokens; see the benchmarks page). Everywhere the tokens stay the model's own.
#
# On CPUs with AVX-512, float32 steps attend through rag-spec's C++ kernel, which reads each
# KV head of the cache once for every query of a step (the benches compare it with SDPA's).
# It makes plain steps cheaper most of all, so speculation adds less on top of it than on
# SDPA, while the two together decode fastest (the benchmarks page, "Long-context batches",
# has the figures).
#
# ## In LangChain and LlamaIndex
#
# The adapters take the drafter as `draft_model` (an instance, or `"self-spec:256"`), and
# their `batch` / `abatch` calls share batches on the decoder:
#
# ```python
# from langchain_rag_spec import ChatLookahead
# chat = ChatLookahead(draft_model="self-spec:256", max_tokens=128)
# answers = chat.batch([messages_1, messages_2, messages_3, messages_4])
# ```
