# %% [markdown]
# # Your own documents
#
# Point rag-spec at a folder of text, Markdown or reStructuredText files (or Python sources),
# build its indexes once, and ask. Indexes are saved in the cache and reused while the files
# stay the same; a changed folder is re-indexed.
#
# We write a small folder here; use your own path instead.

# %%
import tempfile
from pathlib import Path

folder = Path(tempfile.mkdtemp()) / "handbook"
folder.mkdir()
(folder / "onboarding.md").write_text(
    "# Onboarding\n\nNew engineers get a laptop on their first day. The VPN client is called "
    "Tunnelbear Pro and the setup code is printed on the welcome card. Ask Priya in IT for "
    "access to the build servers.\n")
(folder / "releases.md").write_text(
    "# Releases\n\nWe release every second Tuesday. The release captain runs `make ship`, "
    "which tags the commit, builds the wheels and uploads them. Hotfixes skip the train but "
    "need two reviews.\n")
(folder / "oncall.txt").write_text(
    "On-call rotates weekly on Mondays at 10:00. Pages go to the #incidents channel. "
    "Escalate to the platform lead after 30 minutes without a fix.\n")

# %% [markdown]
# ## Build the indexes
#
# The same sources work on the command line: `rag-spec index build --source PATH --kind all`.

# %%
import rag_spec

for kind in ("bm25", "flat"):
    kb = rag_spec.KnowledgeBase.open([str(folder)], kind=kind)
    print(kind, len(kb), "passages;", kb.search(["when do we release?"], k=1)[0][0].title)

# %% [markdown]
# ## Ask
#
# `ask` retrieves the top passages, then answers with lookahead decoding, streaming the text.

# %%
from rag_spec import ask

lm = rag_spec.load_model()
answer = ask(lm, kb, "How often do we release, and who runs it?", k=2, max_new_tokens=64,
             on_text=lambda piece: print(piece, end="", flush=True))
print("\n\nsources:", [hit.title for hit in answer.hits])
print(f"{len(answer.token_ids)} tokens at {answer.tokens_per_second:.1f} tok/s")
