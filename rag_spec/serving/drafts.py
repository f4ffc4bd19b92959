"""What users pass as a draft (a name, a folder, a model, a layer count) turned into a drafter.

A draft model is merged with the trie: copies of the retrieved passages keep being drafted, the
model adds its guesses where there is nothing to copy.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rag_spec.errors import RagSpecError
from rag_spec.models import loader
from rag_spec.models.loader import LoadedModel
from rag_spec.models.registry import EMBEDDED_MODELS

if TYPE_CHECKING:  # the CLI reads this module's help text before torch loads
    from rag_spec.drafters.drafter import Drafter

# "early-exit:8": the target's own first 8 layers; "trained-exit:8": with a trained adapter
_EARLY_EXIT = re.compile(r"(early|trained)[-_]exit(?::(.*))?")
# "head": a draft head on the target's last hidden states (trained on the default corpus)
_HEAD = re.compile(r"(draft[-_])?head")
# "self-spec:256": the target itself through a StreamingLLM view of 256 KV entries
_SELF_SPEC = re.compile(r"self[-_]spec(?::(.*))?")

DRAFT_HELP = ("a draft model of the target's vocabulary: an embedded name, a model folder, "
              "early-exit:L (the target's own first L layers), trained-exit:L (with an "
              "adapter trained on the default corpus, see rag-spec draft train), head (a draft "
              "head on the target's hidden states, rag-spec draft train --head) or "
              "self-spec:N (the target itself reading N KV entries: long contexts)")


def check_draft(draft: Any) -> None:
    """Refuse a draft spelled wrongly before anything loads: a layer or entry count that is
    no positive number, or a name that is neither a draft kind, an embedded model nor a model
    folder. (Whether the target has L layers is checked once it is loaded, by
    ``drafter_for``.)"""
    if not isinstance(draft, str):
        return
    _parse(draft)


def _parse(draft: str) -> tuple[str, int | None]:
    """(kind, count) of a draft string; kind is early-exit, trained-exit, head, self-spec, or
    model (a name or folder, checked to exist)."""
    text = draft.strip()
    match = _EARLY_EXIT.fullmatch(text)
    if match:
        kind = f"{match.group(1)}-exit"
        return kind, _count(draft, kind, match.group(2), "layers")
    match = _SELF_SPEC.fullmatch(text)
    if match:
        count = match.group(1)
        return "self-spec", 256 if count is None else _count(draft, "self-spec", count,
                                                              "KV entries")
    if _HEAD.fullmatch(text):
        return "head", None
    if text in EMBEDDED_MODELS or (Path(text).expanduser() / "config.json").is_file():
        return "model", None
    msg = f"--draft {draft} names no draft: pass {DRAFT_HELP}."
    raise RagSpecError(msg)


def _count(draft: str, kind: str, count: str | None, what: str) -> int:
    if count is None or not count.strip().isdigit() or int(count) < 1:
        msg = f"--draft {draft}: {kind}:N takes N >= 1 {what} (e.g. {kind}:8); got {count!r}."
        raise RagSpecError(msg)
    return int(count)


def drafter_for(draft: Any, target: LoadedModel) -> Drafter | None:
    """The drafter for ``draft``: None (the decoder's default: draft head + trie where the
    model has a head, else the trie), a Drafter (as given), an int or
    ``"early-exit:L"`` (the target's first L layers), ``"trained-exit:L"`` (with the adapter
    ``rag-spec draft train --layers L`` trained), ``"head"`` (the draft head ``rag-spec draft
    train --head`` trained), ``"self-spec:N"`` (the target through a sparse view of N KV
    entries, default 256), a name or folder (loaded on the target's device and dtype), a
    ``LoadedModel`` or a transformers model.

    Serving never trains: a trained draft that is not cached is a RagSpecError naming the
    command that trains it, raised here, before any answer starts."""
    from rag_spec.drafters.drafter import Drafter
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
    from rag_spec.drafters.self_drafter import SelfSpecDrafter
    from rag_spec.training.train_exit import cached_exit

    if draft is None or isinstance(draft, Drafter):
        return draft
    if isinstance(draft, int) and not isinstance(draft, bool):
        draft = f"early-exit:{draft}"
    if isinstance(draft, str):
        kind, count = _parse(draft)
        if kind.endswith("exit"):
            _check_layers(target, count or 0)
            adapter = cached_exit(target, count or 0, train=False) if kind == "trained-exit" \
                else None
            return MergedDrafter(EarlyExitDrafter(count or 0, adapter=adapter))
        if kind == "head":
            from rag_spec.drafters.feature_drafter import FeatureDrafter
            from rag_spec.training.train_head import cached_head

            return MergedDrafter(FeatureDrafter(cached_head(target, train=False)))
        if kind == "self-spec":
            return SelfSpecDrafter(budget=count or 256)
        # looked up when called, so a loader replaced at runtime is the one used
        draft = loader.load_model(draft, device=str(target.device), dtype=target.dtype)
    if isinstance(draft, LoadedModel):
        draft = draft.model
    if getattr(draft, "config", None) is None:
        msg = f"Cannot draft with {type(draft).__name__}: pass {DRAFT_HELP}."
        raise RagSpecError(msg)
    return MergedDrafter(DraftModelDrafter(draft))


def _check_layers(target: LoadedModel, layers: int) -> None:
    """An exit after ``layers`` layers needs a target with more."""
    depth = int(getattr(target.model.config, "num_hidden_layers", 0) or 0)
    if depth and not 1 <= layers < depth:
        msg = (f"--draft early-exit:{layers} / trained-exit:{layers}: an exit needs 1 <= L < "
               f"{depth}, the layers of {target.name}.")
        raise RagSpecError(msg)


def draft_key(draft: Any) -> Any:
    """What identifies a draft among shared instances (names by value, objects by identity)."""
    return draft if draft is None or isinstance(draft, (str, int)) else id(draft)
