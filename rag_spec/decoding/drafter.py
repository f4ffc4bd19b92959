"""The drafting seam: a Drafter opens a session per request; a session proposes TokenTrees.

Drafters never see target logits; the verifier never knows which drafter it talks to.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from rag_spec.decoding.tree import TokenTree


class DraftSession(Protocol):
    """Drafting state for one request."""

    def propose(self, context: Sequence[int], budget: int) -> TokenTree:
        """A tree of at most ``budget`` nodes continuing ``context`` (empty when unsure)."""
        ...

    def observe(self, context: Sequence[int], new_from: int) -> None:
        """``context[new_from:]`` was just committed (accepted tokens plus the bonus)."""
        ...

    def finish(self, output: Sequence[int]) -> None:
        """The request ended with ``output``; keep what is worth keeping across requests."""
        ...

    def add_documents(self, documents: Sequence[Sequence[int]]) -> None:
        """More text this request may copy from (e.g. a passage retrieved mid-generation)."""
        ...


class Drafter(Protocol):
    """A source of drafts shared by requests."""

    def session(self, prompt: Sequence[int], extra_context: Sequence[Sequence[int]] = ()
                ) -> DraftSession:
        """Open a session for a request with ``prompt`` and optional extra documents."""
        ...
