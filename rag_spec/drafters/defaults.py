"""The drafter a decoder gets when none is given: the fastest that exists without a wait.

A trained draft head merged with the trie where one exists for the model (shipped with rag-spec
for the embedded model, or trained by the user with ``rag-spec draft train --head``); the trie
alone otherwise. Nothing is trained here: serving loads what exists.
"""

from __future__ import annotations

from typing import Any

from rag_spec.drafters.draft_head import find_head
from rag_spec.drafters.drafter import Drafter
from rag_spec.drafters.feature_drafter import FeatureDrafter
from rag_spec.drafters.merged_drafter import MergedDrafter
from rag_spec.drafters.trie_drafter import TrieConfig, TrieDrafter


def default_drafter(model: Any, trie: TrieConfig | None = None) -> Drafter:
    """Head + trie where a trained head for ``model`` exists, else the trie (``trie``: its
    settings)."""
    copies = TrieDrafter.from_config(trie or TrieConfig())
    head = find_head(model)
    return copies if head is None else MergedDrafter(FeatureDrafter(head), copies)
