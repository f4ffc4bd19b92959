"""What every retriever speaks: a batch of queries in, ranked hits per query out."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import numpy as np

from rag_spec.errors import RagSpecError


@dataclass(frozen=True)
class Hit:
    """One retrieved passage with its score (higher is better).

    ``doc_id`` is the passage's key in its knowledge base: a position in a local index, a
    primary key in Milvus, a hash of a framework document's id. ``vector`` is the passage's
    embedding where the store returns it (Milvus does), so guesses can be scored locally.
    """

    doc_id: int
    score: float
    title: str
    text: str
    vector: np.ndarray | None = field(default=None, compare=False, repr=False)


@runtime_checkable
class Retriever(Protocol):
    """Anything that searches a batch of queries in one call."""

    def search(self, queries: Sequence[str], k: int = 1) -> list[list[Hit]]:
        """Top-``k`` hits for each query, best first."""
        ...


def stable_id(key: str) -> int:
    """A non-negative 63-bit id for a string key: equal keys, equal ids, nothing remembered
    (a Milvus INT64 primary key; a framework document's id)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big") >> 1


def check_search_args(queries: Sequence[str], k: int) -> None:
    """The mistakes every knowledge base refuses the same way."""
    if isinstance(queries, str):
        msg = "search() takes a list of queries; wrap a single query as [query]."
        raise RagSpecError(msg)
    if k < 1:
        msg = f"k must be at least 1 (got {k})."
        raise RagSpecError(msg)
    blank = [i for i, query in enumerate(queries)
             if not isinstance(query, str) or not query.strip()]
    if blank:
        msg = (f"search() takes non-empty query strings; query {blank[0]} is "
               f"{queries[blank[0]]!r}, which every passage matches as well as any other. "
               f"Drop it, or ask something.")
        raise RagSpecError(msg)


def require_retriever(source: object, accepted: str) -> Retriever:
    """``source`` if it is a Retriever, else an error that lists what is ``accepted``."""
    if isinstance(source, Retriever):
        return source
    msg = (f"SpecRetriever cannot search a {type(source).__name__}. Pass {accepted}, or nothing "
           "(the default knowledge base).")
    raise RagSpecError(msg)
