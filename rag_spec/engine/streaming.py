"""Turn a growing list of output tokens into text pieces that never need taking back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from rag_spec.engine.stopping import StopRule


class TextStream:
    """Sends each new, settled piece of text to ``sink`` (a callable, or a transformers streamer).

    A piece is settled when it is not a partial UTF-8 character and cannot still turn into a
    stop string; so the pieces always concatenate to the final text.
    """

    def __init__(self, sink: Callable[[str], None] | Any, rule: StopRule,
                 prompt: Sequence[int]) -> None:
        self.sink = sink
        self.rule = rule
        self.sent_chars = 0
        self.sent_tokens = 0
        from transformers.generation.streamers import BaseStreamer

        self.streamer = isinstance(sink, BaseStreamer)
        if self.streamer:  # transformers streamers expect the prompt first
            import torch

            sink.put(torch.tensor([list(prompt)]))

    def update(self, output: Sequence[int], finished: bool) -> None:
        if self.streamer:
            import torch

            if len(output) > self.sent_tokens:
                self.sink.put(torch.tensor(list(output[self.sent_tokens:])))
                self.sent_tokens = len(output)
            if finished:
                self.sink.end()
            return
        text = self.rule.final_text(output) if finished else self.rule.text(output)
        end = len(text) if finished else len(text) - self.rule.holdback()
        if not finished:
            while end > self.sent_chars and text[end - 1] == "\ufffd":
                end -= 1
        if end > self.sent_chars:
            self.sink(text[self.sent_chars:end])
            self.sent_chars = end
