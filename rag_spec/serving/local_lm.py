"""One local model serving many callers: text or chat prompts, batched lossless generation,
and streaming as plain or async iterators. The LangChain and LlamaIndex adapters sit on this.

Every forward pass runs on one worker thread (a Coalescer), so callers on any thread or event
loop are safe, and requests that arrive together with the same options decode as one batch.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from rag_spec.coalesce import Coalescer
from rag_spec.decoding.decoder import DecodeStats, LookaheadConfig, LookaheadDecoder
from rag_spec.errors import RagSpecError
from rag_spec.models.loader import LoadedModel, load_model
from rag_spec.models.registry import DEFAULT_MODEL
from rag_spec.serving.prompts import chat_input_ids, merge_turns

Messages = Sequence[Mapping[str, str]]  # [{"role": ..., "content": ...}, ...]
Prompt = str | Messages  # text is completed as is; messages get the chat template


@dataclass(frozen=True)
class GenerateOptions:
    """Per-call decoding settings; ``temperature == 0`` means greedy."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def decoder_kwargs(self) -> dict[str, Any]:
        sample = self.temperature > 0
        return {"max_new_tokens": self.max_new_tokens, "do_sample": sample,
                "temperature": self.temperature if sample else 1.0, "top_k": self.top_k,
                "top_p": self.top_p, "repetition_penalty": self.repetition_penalty,
                "stop": list(self.stop), "seed": self.seed}


@dataclass(frozen=True)
class Completion:
    """A finished generation with its token counts, speculation stats and wall time."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop" or "length"
    stats: DecodeStats
    seconds: float  # from the start of decoding to the last token (queueing excluded)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / max(self.seconds, 1e-9)


@dataclass(frozen=True)
class Chunk:
    """A settled piece of streamed text; the last chunk also carries the whole Completion."""

    text: str
    completion: Completion | None = None


@dataclass(frozen=True)
class _Job:
    prompt_ids: list[int]
    options: GenerateOptions
    context: tuple[str, ...]
    sink: Callable[[str], None] | None = None  # streaming jobs run alone
    cancelled: threading.Event = field(default_factory=threading.Event)


class _Cancelled(Exception):
    """The consumer stopped reading a stream; the decoder unwinds and frees the model."""


class LocalLM:
    """A loaded model behind a lookahead decoder and a batching worker.

    Use ``LocalLM.shared(name)`` to get the one instance per model in this process.

    Example:
        >>> lm = LocalLM.shared()                                          # doctest: +SKIP
        >>> lm.generate([[{"role": "user", "content": "Hi"}]])[0].text    # doctest: +SKIP
    """

    _instances: dict[tuple[int, LookaheadConfig], LocalLM] = {}
    _instances_lock = threading.Lock()

    def __init__(self, lm: LoadedModel, config: LookaheadConfig | None = None, *,
                 batch_wait_ms: float = 5.0, max_batch: int = 8) -> None:
        self.lm = lm
        self.decoder = LookaheadDecoder(lm.model, lm.tokenizer, config)
        self._worker = Coalescer(self._run, wait_ms=batch_wait_ms, max_batch=max_batch,
                                 name=f"rag-spec {lm.name}")

    @classmethod
    def shared(cls, model: str | LoadedModel | None = None, *, config: LookaheadConfig | None
               = None, **load_kwargs: Any) -> LocalLM:
        """The process-wide LocalLM for ``model`` (a name, a folder, or a loaded model)."""
        lm = model if isinstance(model, LoadedModel) else load_model(
            model or DEFAULT_MODEL, **load_kwargs)
        key = (id(lm), config or LookaheadConfig())
        with cls._instances_lock:
            if key not in cls._instances:
                cls._instances[key] = cls(lm, config)
            return cls._instances[key]

    @property
    def name(self) -> str:
        return self.lm.name

    @property
    def context_window(self) -> int:
        return int(getattr(self.lm.model.config, "max_position_embeddings", 2048))

    @property
    def lock(self) -> threading.RLock:
        """Held while the model computes; hold it to run other work on the same model."""
        return self.decoder._lock

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of a text prompt, or of chat messages with the generation prompt added."""
        if isinstance(prompt, str):
            return list(self.lm.tokenizer(prompt)["input_ids"])
        if not prompt:
            msg = "No messages to answer; pass at least one user message."
            raise RagSpecError(msg)
        return chat_input_ids(self.lm.tokenizer, merge_turns(prompt))

    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions | None = None,
                 context: Sequence[str] = ()) -> list[Completion]:
        """Complete each prompt; prompts of one call (and concurrent calls) share batches."""
        futures = self._submit(prompts, options, context)
        return [f.result() for f in futures]

    async def agenerate(self, prompts: Sequence[Prompt], options: GenerateOptions | None = None,
                        context: Sequence[str] = ()) -> list[Completion]:
        """``generate`` for event loops: awaits the worker without blocking the loop."""
        futures = self._submit(prompts, options, context)
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in futures)))

    def stream(self, prompt: Prompt, options: GenerateOptions | None = None,
               context: Sequence[str] = ()) -> Iterator[Chunk]:
        """Yield text as the decoder settles it; the last chunk carries the Completion.

        Stopping early (``break``) cancels the generation at its next step.
        """
        pieces: queue.SimpleQueue[Any] = queue.SimpleQueue()
        job = self._stream_job(prompt, options, context, pieces.put)
        future = self._worker.submit(job, key=object())  # a key of its own: never batched
        future.add_done_callback(pieces.put)
        try:
            while not isinstance(item := pieces.get(), Future):
                yield Chunk(item)
            yield Chunk("", item.result())
        finally:
            job.cancelled.set()

    async def astream(self, prompt: Prompt, options: GenerateOptions | None = None,
                      context: Sequence[str] = ()) -> AsyncIterator[Chunk]:
        """``stream`` for event loops: each chunk is awaited, the loop never blocks."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, item)

        job = self._stream_job(prompt, options, context, put)
        future = self._worker.submit(job, key=object())
        future.add_done_callback(put)
        try:
            while not isinstance(item := await pieces.get(), Future):
                yield Chunk(item)
            yield Chunk("", item.result())
        finally:
            job.cancelled.set()

    def _stream_job(self, prompt: Prompt, options: GenerateOptions | None,
                    context: Sequence[str], put: Callable[[str], None]) -> _Job:
        cancelled = threading.Event()

        def sink(text: str) -> None:
            if cancelled.is_set():
                raise _Cancelled
            put(text)

        return _Job(self.encode(prompt), _checked(options), tuple(context), sink, cancelled)

    def _submit(self, prompts: Sequence[Prompt], options: GenerateOptions | None,
                context: Sequence[str]) -> list[Future[Completion]]:
        options = _checked(options)
        key = (options, tuple(context))  # only requests with equal keys share a batch
        return [self._worker.submit(_Job(self.encode(p), options, tuple(context)), key=key)
                for p in prompts]

    def _run(self, _key: Any, jobs: Sequence[_Job]) -> list[Completion]:
        """Worker thread: decode one batch (or one streaming job) of same-option requests."""
        first = jobs[0]
        started = time.perf_counter()
        results = self.decoder.generate([j.prompt_ids for j in jobs], streamer=first.sink,
                                        context=first.context,
                                        **first.options.decoder_kwargs())
        seconds = time.perf_counter() - started
        return [Completion(r.text, r.token_ids, len(j.prompt_ids), r.finish_reason, r.stats,
                           seconds) for r, j in zip(results, jobs)]


def _checked(options: GenerateOptions | None) -> GenerateOptions:
    options = options or GenerateOptions()
    if options.max_new_tokens < 1:
        msg = f"max_new_tokens must be at least 1 (got {options.max_new_tokens})."
        raise RagSpecError(msg)
    return options
