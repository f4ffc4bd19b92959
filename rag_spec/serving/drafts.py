"""What users pass as a draft (a name, a folder, a model, a layer count) turned into a drafter.

A draft model is merged with the trie: copies of the retrieved passages keep being drafted, the
model adds its guesses where there is nothing to copy.
"""

from __future__ import annotations

import re
from typing import Any

from rag_spec.decoding.drafter import Drafter
from rag_spec.errors import RagSpecError
from rag_spec.models import loader
from rag_spec.models.loader import LoadedModel

# "early-exit:8": the target's own first 8 layers; "trained-exit:8": with a trained adapter
_EARLY_EXIT = re.compile(r"(early|trained)[-_]exit:(\d+)")
# "head": a draft head on the target's last hidden states (trained on the default corpus)
_HEAD = re.compile(r"(draft[-_])?head")
# "self-spec:256": the target itself through a StreamingLLM view of 256 KV entries
_SELF_SPEC = re.compile(r"self[-_]spec(?::(\d+))?")

DRAFT_HELP = ("a draft model of the target's vocabulary: an embedded name, a model folder, "
              "early-exit:L (the target's own first L layers), trained-exit:L (with an "
              "adapter trained on the default corpus, see rag-spec draft train), head (a draft "
              "head on the target's hidden states, rag-spec draft train --head) or "
              "self-spec:N (the target itself reading N KV entries: long contexts)")


def drafter_for(draft: Any, target: LoadedModel) -> Drafter | None:
    """The drafter for ``draft``: None (the trie alone), a Drafter (as given), an int or
    ``"early-exit:L"`` (the target's first L layers), ``"trained-exit:L"`` (with the adapter
    trained on the default corpus: trained now if not cached), ``"head"`` (a draft head on the
    target's hidden states, likewise), ``"self-spec:N"`` (the target
    through a sparse view of N KV entries, default 256), a name or folder (loaded on the
    target's device and dtype), a ``LoadedModel`` or a transformers model."""
    from rag_spec.decoding.exit_adapter import cached_exit
    from rag_spec.decoding.merged_drafter import MergedDrafter
    from rag_spec.decoding.model_drafter import DraftModelDrafter, EarlyExitDrafter
    from rag_spec.decoding.self_drafter import SelfSpecDrafter

    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, int) and not isinstance(draft, bool):
        return MergedDrafter(EarlyExitDrafter(draft))
    if isinstance(draft, str):
        match = _EARLY_EXIT.fullmatch(draft.strip())
        if match:
            layers = int(match.group(2))
            adapter = cached_exit(target, layers) if match.group(1) == "trained" else None
            return MergedDrafter(EarlyExitDrafter(layers, adapter=adapter))
        if _HEAD.fullmatch(draft.strip()):
            from rag_spec.decoding.draft_head import cached_head
            from rag_spec.decoding.feature_drafter import FeatureDrafter

            return MergedDrafter(FeatureDrafter(cached_head(target)))
        match = _SELF_SPEC.fullmatch(draft.strip())
        if match:
            return SelfSpecDrafter(budget=int(match.group(1) or 256))
        # looked up when called, so a loader replaced at runtime is the one used
        draft = loader.load_model(draft, device=str(target.device), dtype=target.dtype)
    if isinstance(draft, LoadedModel):
        draft = draft.model
    if getattr(draft, "config", None) is None:
        msg = f"Cannot draft with {type(draft).__name__}: pass {DRAFT_HELP}."
        raise RagSpecError(msg)
    return MergedDrafter(DraftModelDrafter(draft))


def draft_key(draft: Any) -> Any:
    """What identifies a draft among shared instances (names by value, objects by identity)."""
    return draft if draft is None or isinstance(draft, (str, int)) else id(draft)
