"""The generation state of iterative RaLM: output tokens plus one KV cache per passage segment.

A segment starts whenever the passage in the prompt changes: its cache is the prompt built from
that passage, the question and the output so far, prefilled once; then each new token extends
it by one step. Rolling back to an earlier retrieval point drops the segments opened after it
and crops the one that was current there, so the cache holds exactly what it would have held
had generation never gone past that point: speculative and naive loops compute identically.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_spec.errors import RagSpecError
from rag_spec.models.limits import context_window
from rag_spec.retrieval.types import Hit
from rag_spec.speculation import Cancel
from rag_spec.target.transformers.kv_cache import cache_argument, crop, new_cache
from rag_spec.target.transformers.prefill import append as fill_cache

Extend = Callable[["Segment", list[int], int], list[int]]
"""Speculative decoding for a segment: (segment, output, n) -> up to n greedy tokens after
``segment.prompt + output``, with the segment's cache advanced as plain steps would have left
it."""

Fill = Callable[[Any, list[int]], None]
"""Prefill for a new segment: (empty cache, tokens) -> None, the cache then holds the tokens."""


@dataclass
class Segment:
    """Generation under one set of passages."""

    passages: list[Hit]
    point: int  # retrieval point that opened it (-1: the first retrieval)
    prompt: list[int]  # the passage + question prompt
    cache: Any  # DynamicCache over prompt + output, all but the newest token (None: served)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


class SegmentHistory:
    """Output so far and the segments that produced it, for one request: what a rollback and
    a verification keep track of, wherever the segments' caches live (here: ``RalmState``;
    on a server: ``ServedState``)."""

    def __init__(self, build_prompt: Callable[[Sequence[Hit]], list[int]],
                 eos_ids: Sequence[int]) -> None:
        self.build_prompt = build_prompt
        self.eos_ids = frozenset(eos_ids)
        self.output: list[int] = []
        self.segments: list[Segment] = []
        self.compute_seconds = 0.0  # prefills and decoding steps (or waiting for them)

    @property
    def passages(self) -> list[Hit]:
        return self.segments[-1].passages

    @property
    def finished(self) -> bool:
        return bool(self.output) and self.output[-1] in self.eos_ids

    def unchanged(self, passages: list[Hit]) -> bool:
        """Whether ``passages`` are the current segment's (its cache goes on)."""
        return bool(self.segments) and (
            [h.doc_id for h in passages] == [h.doc_id for h in self.passages])

    def drop_after(self, point: int, length: int) -> Segment:
        """Back to retrieval ``point``, where the output had ``length`` tokens: the segments
        opened after it dropped; returns the one current there."""
        del self.output[length:]
        while len(self.segments) > 1 and self.segments[-1].point >= point:
            self.segments.pop()
        return self.segments[-1]

    def forget_before(self, point: int) -> None:
        """Verified up to ``point``: segments no rollback can return to can go."""
        while len(self.segments) > 1 and self.segments[1].point <= point:
            self.segments.pop(0)


class RalmState(SegmentHistory):
    """Output so far and the segments that produced it, for one request, each segment's KV
    cache in this process."""

    def __init__(self, model: Any, build_prompt: Callable[[Sequence[Hit]], list[int]],
                 eos_ids: Sequence[int], extend: Extend | None = None,
                 fill: Fill | None = None) -> None:
        super().__init__(build_prompt, eos_ids)
        self.model = model
        self.extend = extend
        self.fill = fill or functools.partial(fill_cache, model)
        self.window = context_window(model.config)

    def use(self, passages: list[Hit], point: int) -> None:
        """Continue under ``passages``: the same ones keep the cache, others open a segment."""
        if self.unchanged(passages):
            return
        started = time.perf_counter()
        prompt = self.build_prompt(passages)
        sequence = prompt + self.output
        if self.window is not None and len(sequence) >= self.window:
            msg = (f"The RaLM prompt (passages, question and answer so far) is {len(sequence)} "
                   f"tokens but the model's context window is {self.window}; retrieve fewer or "
                   "shorter passages (k, passage size) or generate fewer tokens.")
            raise RagSpecError(msg)
        cache = new_cache()
        if len(sequence) > 1:
            self.fill(cache, sequence[:-1])
        self.segments.append(Segment(passages, point, prompt, cache))
        self.compute_seconds += time.perf_counter() - started

    def step(self, n: int, cancel: Cancel | None = None) -> int:
        """Greedily decode up to ``n`` tokens (fewer at EOS, or once ``cancel`` is set: one
        token at a time it stops between tokens; a speculative stride runs whole); returns how
        many were added."""
        started = time.perf_counter()
        segment = self.segments[-1]
        if self.window is not None:  # the next retrieval reports the full window
            n = min(n, self.window - segment.prompt_len - len(self.output))
        added = 0  # the cache holds prompt + output but the newest token, which goes in next
        if self.extend is not None and not self.finished:
            tokens = self.extend(segment, self.output, n)
            self.output.extend(tokens)
            added = len(tokens)
        while added < n and not self.finished and not (cancel and cancel.is_set()):
            pending = self.output[-1] if self.output else segment.prompt[-1]
            logits = self.model(input_ids=torch.tensor([[pending]], device=self.model.device),
                                use_cache=True, **cache_argument(self.model, segment.cache)
                                ).logits
            self.output.append(int(logits[0, -1].argmax()))
            added += 1
        self.compute_seconds += time.perf_counter() - started
        return added

    def rollback(self, point: int, length: int) -> None:
        """Return to retrieval ``point``, where the output had ``length`` tokens."""
        segment = self.drop_after(point, length)
        crop(segment.cache, segment.prompt_len + length - 1)
