# %% [markdown]
# # Draft models, early exits and merged drafts
#
# The trie drafts what is already written somewhere: the prompt, the retrieved passages,
# earlier answers. A *draft model* guesses what is not. This notebook drafts with three
# sources, checks that every one of them leaves the answer unchanged, and reads what each
# one was worth per forward pass.
#
# On this machine there is no smaller model of the embedded model's family, so the draft is
# the embedded model's own first 8 of 30 layers: saved as a model folder of its own (what
# you would pass for a real draft, e.g. Llama-3.2-1B for Llama-3.1-8B), and as an early exit
# that shares the weights.

# %%
import matplotlib.pyplot as plt

import rag_spec
from rag_spec import (
    DraftModelDrafter,
    EarlyExitDrafter,
    Expansion,
    LookaheadConfig,
    LookaheadDecoder,
    MergedDrafter,
)
from rag_spec import first_layers_folder
from rag_spec import chat_input_ids

lm = rag_spec.load_model()
draft = rag_spec.load_model(str(first_layers_folder(lm, 8)))
question = [{"role": "user", "content": "Explain how a hash table works."}]
prompt = chat_input_ids(lm.tokenizer, question)
plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0))
expected = plain.generate(prompt, max_new_tokens=48)
print(expected.text)

# %% [markdown]
# ## The same answer from every drafter
#
# `DraftModelDrafter` takes any causal LM with the target's vocabulary; `EarlyExitDrafter`
# drafts with the target's own first layers; `MergedDrafter` joins a model's guesses with the
# trie's copies in one tree. The last one is the model drafting for itself: it agrees
# everywhere, so each step keeps a full-depth draft (and costs four extra passes: a draft
# only pays when it is much cheaper than the target).

# %%
drafters = {
    "draft model": DraftModelDrafter(draft.model),
    "early exit": EarlyExitDrafter(layers=8),
    "merged with the trie": MergedDrafter(DraftModelDrafter(draft.model)),
    "the model itself": DraftModelDrafter(
        lm.model, expansion=Expansion(widths=(1,), max_depth=4, adaptive_depth=False)),
}
results = {}
for name, drafter in drafters.items():
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, drafter=drafter)
    results[name] = result = decoder.generate(prompt, max_new_tokens=48)
    stats = result.stats
    print(f"{name:22} identical: {result.token_ids == expected.token_ids}  "
          f"{stats.tokens_per_step:.2f} tokens per step, {stats.steps} steps, "
          f"{sum(stats.accepted_per_step)}/{stats.drafted} drafted tokens accepted")
    assert result.token_ids == expected.token_ids

# %% [markdown]
# An untrained 8-layer exit rarely agrees with the full model (transformers'
# `assistant_early_exit=8` is several times slower than plain decoding for that reason). Ours
# measures what its drafts earn: a draft pass runs only while the measured acceptance pays for
# it, and the budget stops drafting while drafts keep missing, probing again after 4, 8, 16 ...
# steps. The plot shows when each drafter drafted at all.

# %%
fig, ax = plt.subplots(figsize=(7, 2.8))
for row, (name, result) in enumerate(results.items()):
    accepted = result.stats.accepted_per_step
    ax.scatter(range(len(accepted)), [row] * len(accepted), s=[8 + 25 * a for a in accepted],
               label=name)
ax.set_yticks(range(len(results)), list(results))
ax.set_xlabel("step (dot size: drafted tokens accepted)")
plt.tight_layout()

# %% [markdown]
# ## Sampling keeps the model's distribution
#
# With `do_sample=True` the draft's children are drawn from its own distribution (processed
# with the same temperature and top-p as the target's) and verified by multi-step speculative
# sampling: a child x is kept with probability min(1, p(x) / q(x)). The output is distributed
# exactly as plain sampling's; a seed fixes it for a given drafter.

# %%
sampler = LookaheadDecoder(lm.model, lm.tokenizer,
                           drafter=MergedDrafter(DraftModelDrafter(draft.model)))
for seed in (1, 2):
    sample = sampler.generate(prompt, max_new_tokens=32, do_sample=True, temperature=0.7,
                              top_p=0.9, seed=seed)
    print(f"seed {seed}: {sample.text!r}")

# %% [markdown]
# ## In LangChain and LlamaIndex
#
# `draft_model` takes a name, a model folder, a model object, or `"early-exit:L"`; a model is
# merged with the trie, so copies of the retrieved passages are still drafted.

# %%
from langchain_rag_spec import ChatLookahead

chat = ChatLookahead(draft_model="early-exit:8", max_tokens=32)
reply = chat.invoke("What is a tuple in Python?")
print(reply.content)
print(reply.response_metadata["speculation"])
