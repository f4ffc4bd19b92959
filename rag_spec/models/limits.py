"""What a model can take: its context window, read from its config or tokenizer."""

from __future__ import annotations

from typing import Any

# Config fields that name the longest sequence, by model family.
_WINDOW_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length",
                  "n_ctx")
# Tokenizers without a limit report a huge placeholder (int(1e30)).
_NO_LIMIT = 10**9


def context_window(config: Any, tokenizer: Any = None) -> int | None:
    """The longest sequence (prompt plus output) the model was built for, or None if unknown."""
    text_config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") \
        else config
    for name in _WINDOW_FIELDS:
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < _NO_LIMIT else None
