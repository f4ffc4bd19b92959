"""Where generation ends: EOS, the token limit, or a stop string (which may span tokens),
exactly where plain one-token-at-a-time decoding would end.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopRule:
    """Decides, token by token, when a row is finished, and renders the final text.

    Token ids keep the token that completed a stop string (as transformers' ``stop_strings``
    does); the text is cut just before the stop string (as LangChain and OpenAI do).
    """

    def __init__(self, tokenizer: Any, eos_ids: Sequence[int], stop: Sequence[str],
                 max_new_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.stop = [s for s in stop if s]
        self.max_new_tokens = max_new_tokens

    def finish_reason(self, output: Sequence[int]) -> str | None:
        """Why ``output`` (whose last token was just added) ends here, or None to go on."""
        if output and output[-1] in self.eos_ids:
            return "eos"
        if self.stop and self._stop_at(self.text(output)) is not None:
            return "stop"
        if len(output) >= self.max_new_tokens:
            return "length"
        return None

    def text(self, output: Sequence[int]) -> str:
        return self.tokenizer.decode(list(output), skip_special_tokens=True)

    def final_text(self, output: Sequence[int]) -> str:
        text = self.text(output)
        cut = self._stop_at(text)
        return text if cut is None else text[:cut]

    def holdback(self) -> int:
        """Characters a stream must hold back: they might still become a stop string."""
        return max((len(s) for s in self.stop), default=1) - 1

    def _stop_at(self, text: str) -> int | None:
        found = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return min(found) if found else None
