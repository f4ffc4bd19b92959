"""What every retriever speaks: a batch of queries in, ranked hits per query out."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Hit:
    """One retrieved passage with its score (higher is better)."""

    doc_id: int  # index of the passage in its knowledge base
    score: float
    title: str
    text: str


@runtime_checkable
class Retriever(Protocol):
    """Anything that searches a batch of queries in one call."""

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        """Top-``k`` hits for each query, best first."""
        ...
