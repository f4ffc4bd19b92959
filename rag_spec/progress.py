"""Progress bars for work that takes minutes (training, generating), on stderr."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def progress(items: Iterable[T], what: str, unit: str, *, enabled: bool = True,
             total: int | None = None) -> Iterable[T]:
    """``items``, with a bar labelled ``rag-spec: {what}`` when ``enabled``."""
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=f"rag-spec: {what}", unit=unit, total=total)
