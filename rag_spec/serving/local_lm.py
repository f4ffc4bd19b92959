"""One local model serving many callers: text or chat prompts, batched lossless generation,
and streaming as plain or async iterators. The LangChain and LlamaIndex adapters sit on this.

Concurrent requests decode as one batch that each joins at its next step and leaves when it
ends, whatever its options (continuous batching: ``serving.scheduler``); the model computes on
a caller's thread, one step at a time, so callers on any thread or event loop are safe.
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections import deque
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rag_spec.engine.batch import DecodeStats
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, warn_incomplete
from rag_spec.errors import RagSpecError
from rag_spec.models.limits import context_window
from rag_spec.models.loader import LoadedModel, load_model
from rag_spec.models.registry import DEFAULT_MODEL
from rag_spec.prompts import chat_input_ids, merge_turns
from rag_spec.serving.drafts import draft_key, drafter_for
from rag_spec.serving.scheduler import Job, Scheduler
from rag_spec.serving.tools import (
    GENERIC,
    CallFormat,
    CutCall,
    Tool,
    ToolCall,
    call_format,
    chat_messages,
    options_grammar,
)
from rag_spec.target.sampling import check_sampling
from rag_spec.threads import run_in_compute_thread
from rag_spec.tokenizing import serial

Messages = Sequence[Mapping[str, Any]]  # [{"role": ..., "content": ...}, ...] (see encode)
Prompt = str | Messages | list[int]  # text and token ids are completed as they are; messages
# get the chat template


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
    json_schema: str | None = None  # the JSON schema the output follows, as JSON text
    grammar: str | None = None  # or the EBNF grammar it follows
    # tools the prompt offers, as JSON, and how they are called: ``serving.tools.tool_options``
    tools: str | None = None
    tool_choice: str = "auto"  # or "any" (a call is made), or a tool's name
    parallel_tool_calls: bool = False  # a forced answer may hold several calls

    def __post_init__(self) -> None:
        """Checked as the decoder checks its own arguments, in the same words, so a framework
        class refuses what ``LookaheadDecoder.generate`` refuses."""
        if self.max_new_tokens < 1:
            msg = f"max_new_tokens must be at least 1 (got {self.max_new_tokens})."
            raise RagSpecError(msg)
        check_sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty,
                       greedy_at_zero=True)

    def decoder_kwargs(self) -> dict[str, Any]:
        sample = self.temperature > 0
        return {"max_new_tokens": self.max_new_tokens, "do_sample": sample,
                "temperature": self.temperature if sample else 1.0, "top_k": self.top_k,
                "top_p": self.top_p, "repetition_penalty": self.repetition_penalty,
                "stop": list(self.stop), "seed": self.seed, "json_schema": self.json_schema,
                "grammar": self.grammar}


@dataclass(frozen=True)
class Completion:
    """A finished generation with its token counts and speculation stats."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    finish_reason: str  # "eos", "stop" (a stop string) or "length"
    stats: DecodeStats
    content: str  # the text outside tool calls (the text, where no tools were offered)
    calls: tuple[ToolCall, ...] = ()  # the calls it made, parsed
    # constrained output (a JSON schema, a grammar, tool calls) that ended before its grammar
    # was complete, at the token limit
    incomplete: bool = False
    cut_call: CutCall | None = None  # a tool call cut at the token limit (not in ``content``)

    @property
    def api_finish_reason(self) -> str:
        """Why it ended, in the OpenAI API's words that LangChain and LlamaIndex pass on:
        "stop" (the model's end of text, or a stop string), "length" (the token limit),
        "tool_calls" (it called tools and ended)."""
        if self.finish_reason == "length":
            return "length"
        return "tool_calls" if self.calls else "stop"

    @property
    def seconds(self) -> float:
        """Time the model spent on this generation (queueing excluded)."""
        s = self.stats
        return s.prefill_seconds + s.draft_seconds + s.forward_seconds + s.bookkeeping_seconds

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / max(self.seconds, 1e-9)

    def usage(self) -> dict[str, Any]:
        """Token counts, as the OpenAI API reports them: ``cached_tokens``, the prompt tokens
        read from stored prefixes rather than computed (``LookaheadConfig.prefix_cache_mb``)."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": len(self.token_ids),
                "total_tokens": self.prompt_tokens + len(self.token_ids),
                "prompt_tokens_details": {"cached_tokens": self.stats.cached_prompt_tokens}}

    def speculation(self) -> dict[str, Any]:
        """How the tokens were produced: steps, drafts verified and kept, speed."""
        s = self.stats
        return {"drafts": s.drafts, "steps": s.steps, "drafted": s.drafted,
                "accepted": sum(s.accepted_per_step),
                "accepted_per_step": list(s.accepted_per_step),
                "tokens_per_step": round(s.tokens_per_step, 3),
                "tokens_per_second": round(self.tokens_per_second, 2),
                "prefill_seconds": round(s.prefill_seconds, 4),
                "prefill_share": round(s.prefill_seconds / max(self.seconds, 1e-9), 3),
                # prompt tokens read from stored prefixes (an agent's earlier turns), not computed
                "cached_prompt_tokens": s.cached_prompt_tokens}


@dataclass(frozen=True)
class Chunk:
    """A settled piece of streamed text; the last chunk also carries the whole Completion."""

    text: str
    completion: Completion | None = None


class LocalLM:
    """A loaded model behind a lookahead decoder that batches concurrent requests
    continuously (up to ``max_batch`` rows at once).

    Use ``LocalLM.shared(name)`` to get the one instance per model in this process.

    Examples:
        >>> lm = LocalLM.shared()                                          # doctest: +SKIP
        >>> lm.generate([[{"role": "user", "content": "Hi"}]])[0].text    # doctest: +SKIP
    """

    _instances: dict[tuple[int, LookaheadConfig, Any, int], LocalLM] = {}
    _instances_lock = threading.Lock()

    def __init__(self, lm: LoadedModel, config: LookaheadConfig | None = None, *,
                 draft: Any = None, batch_wait_ms: float = 5.0, max_batch: int = 8) -> None:
        self.lm = lm
        self.decoder = LookaheadDecoder(lm.model, lm.tokenizer, config,
                                        drafter=drafter_for(draft, lm))
        self._tokens = serial(lm.tokenizer)  # callers encode on their own threads
        self._scheduler = Scheduler(self.decoder, max_rows=max_batch, wait_ms=batch_wait_ms)

    @classmethod
    def shared(cls, model: str | LoadedModel | None = None, *, config: LookaheadConfig | None
               = None, draft: Any = None, max_batch: int = 8, **load_kwargs: Any) -> LocalLM:
        """The process-wide LocalLM for ``model`` (a name, a folder, or a loaded model),
        ``draft`` (see ``rag_spec.serving.drafts.drafter_for``; None: the default drafter, the
        model's draft head + the trie where it has one, else the trie) and ``max_batch`` (the
        most rows decoding at once)."""
        lm = model if isinstance(model, LoadedModel) else load_model(
            model or DEFAULT_MODEL, **load_kwargs)
        key = (id(lm), config or LookaheadConfig(), draft_key(draft), max_batch)
        with cls._instances_lock:
            if key not in cls._instances:
                cls._instances[key] = cls(lm, config, draft=draft, max_batch=max_batch)
            return cls._instances[key]

    @property
    def name(self) -> str:
        return self.lm.name

    @property
    def context_window(self) -> int | None:
        """Longest prompt plus output the model takes (None: its config does not say)."""
        return context_window(self.lm.model.config, self.lm.tokenizer)

    def warm_up(self, *, progress: bool = True) -> float:
        """``LookaheadDecoder.warm_up``: a first request's one-time costs (compiling, with
        ``compile=True``) paid now, requests held meanwhile; returns its seconds."""
        with self.exclusive():
            return self.decoder.warm_up(progress=progress)

    def forget_prefixes(self) -> int:
        """``LookaheadDecoder.forget_prefixes``: the stored prompt entries dropped."""
        return self.decoder.forget_prefixes()

    def exclusive(self) -> Any:
        """A context manager that holds the model for other work (e.g. an iterative RaLM
        loop), once the requests in flight have ended."""
        return self._scheduler.exclusive()

    def encode(self, prompt: Prompt, tools: str | None = None) -> list[int]:
        """Token ids of a text prompt, or of chat messages with the generation prompt added
        (and ``tools``, JSON of ``serving.tools.Tool.openai`` entries, offered: through the
        chat template's tools section, else in a system message). An assistant message may
        carry ``tool_calls`` (``ToolCall``s), a ``tool`` message ``tool_call_id`` and
        ``name``: see ``serving.tools.chat_messages``."""
        if isinstance(prompt, str):
            return list(self._tokens(prompt)["input_ids"])
        if prompt and all(isinstance(token, int) for token in prompt):
            vocabulary = self.lm.model.config.vocab_size
            if not all(0 <= token < vocabulary for token in prompt):  # type: ignore[operator]
                msg = (f"A prompt's token ids are 0 to {vocabulary - 1} for this model; "
                       "tokenize it with the served model's tokenizer.")
                raise RagSpecError(msg)
            return list(prompt)  # type: ignore[arg-type]
        if not prompt:
            msg = "No messages to answer; pass at least one user message."
            raise RagSpecError(msg)
        offered = [Tool.from_openai(spec) for spec in json.loads(tools)] if tools else []
        native = self.call_format is not GENERIC  # the template has a tools section
        messages = chat_messages(prompt, offered, form=self.call_format, native=native)
        return chat_input_ids(self._tokens, merge_turns(messages),
                              tools=[t.openai() for t in offered] if native else None)

    @functools.cached_property
    def call_format(self) -> CallFormat:
        """How this model writes tool calls (read from its chat template)."""
        return call_format(self._tokens)

    def generate(self, prompts: Sequence[Prompt], options: GenerateOptions | None = None,
                 context: Sequence[str] = ()) -> list[Completion]:
        """Complete each prompt; prompts of one call and of concurrent calls share the batch
        in flight. With a ``seed``, prompt ``b`` of the call samples with ``seed + b``."""
        options = _checked(options)
        jobs = self._submit(prompts, options, context)
        results = self._scheduler.complete(jobs)
        warn_incomplete(results)
        return self._completions(jobs, results, options)

    async def agenerate(self, prompts: Sequence[Prompt], options: GenerateOptions | None = None,
                        context: Sequence[str] = ()) -> list[Completion]:
        """``generate`` for event loops: the loop never blocks; concurrent calls share the
        batch, which runs on rag-spec's compute thread."""
        options = _checked(options)
        jobs = self._submit(prompts, options, context)
        results = await run_in_compute_thread(self._scheduler.complete, jobs)
        warn_incomplete(results)
        return self._completions(jobs, results, options)

    def stream(self, prompt: Prompt, options: GenerateOptions | None = None,
               context: Sequence[str] = ()) -> Iterator[Chunk]:
        """Yield text as the decoder settles it; the last chunk carries the Completion.

        Stopping early (``break``) ends the generation at the batch's next step.
        """
        options = _checked(options)
        pieces: deque[str] = deque()
        job = self._submit([prompt], options, context, sink=pieces.append)[0]
        try:
            while not job.done:
                self._scheduler.advance(lambda: bool(pieces) or job.done)
                while pieces:
                    yield Chunk(pieces.popleft())
            while pieces:
                yield Chunk(pieces.popleft())
        finally:
            if not job.done:  # its row ends at the next step, which this thread leads if free
                self._scheduler.cancel(job)
                self._scheduler.complete([job])
        warn_incomplete([job.future.result()])
        yield Chunk("", self._completions([job], [job.future.result()], options)[0])

    async def astream(self, prompt: Prompt, options: GenerateOptions | None = None,
                      context: Sequence[str] = ()) -> AsyncIterator[Chunk]:
        """``stream`` for event loops: decoding runs on rag-spec's compute thread; chunks are
        awaited. Leaving early (a client that disconnects) ends the generation at the batch's
        next step."""
        options = _checked(options)
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue[str | None] = asyncio.Queue()
        def sink(piece: str) -> None:
            loop.call_soon_threadsafe(pieces.put_nowait, piece)

        job = self._submit([prompt], options, context, sink=sink)[0]
        worker = asyncio.ensure_future(run_in_compute_thread(self._scheduler.complete, [job]))
        # after the pieces: both are handed to the loop in the order the compute thread ran
        worker.add_done_callback(lambda done: pieces.put_nowait(None) or _retrieved(done))
        try:
            while (piece := await pieces.get()) is not None:
                yield Chunk(piece)
            result = (await worker)[0]
        finally:
            if not worker.done():
                self._scheduler.cancel(job)
        warn_incomplete([result])
        yield Chunk("", self._completions([job], [result], options)[0])

    def _submit(self, prompts: Sequence[Prompt], options: GenerateOptions,
                context: Sequence[str], sink: Any = None) -> list[Job]:
        """Queue each prompt as a request of its own (they decode in the batch in flight)."""
        kwargs = self._decoder_kwargs(options)
        if context:
            kwargs["context"] = tuple(context)
        ids = [self.encode(p, options.tools) for p in prompts]
        seed = options.seed
        return [self._scheduler.submit(p, {**kwargs, "seed": None if seed is None else seed + b},
                                       sink) for b, p in enumerate(ids)]

    def _completions(self, jobs: Sequence[Job], results: Sequence[Any],
                     options: GenerateOptions) -> list[Completion]:
        return [self._completion(r, len(j.prompt), options) for j, r in zip(jobs, results)]

    def _decoder_kwargs(self, options: GenerateOptions) -> dict[str, Any]:
        """The decoder's settings; with tools, the grammar of calls in this model's format."""
        kwargs = options.decoder_kwargs()
        if options.tools:
            kwargs["grammar"] = options_grammar(self.call_format, options.tools,
                                                options.tool_choice, options.parallel_tool_calls)
        return kwargs

    def _completion(self, result: Any, prompt_tokens: int,
                    options: GenerateOptions) -> Completion:
        text, cut_call = result.text, None
        if options.tools and result.incomplete:
            at = self.call_format.unfinished(text, forced=options.tool_choice != "auto")
            if at is not None:
                text, cut_call = text[:at], self.call_format.cut(text[at:], options.tool_choice)
        content, calls = self.call_format.parse(text) if options.tools else (text, [])
        return Completion(result.text, result.token_ids, prompt_tokens, result.finish_reason,
                          result.stats, content, tuple(calls), result.incomplete, cut_call)


def _checked(options: GenerateOptions | None) -> GenerateOptions:
    return options or GenerateOptions()


def _retrieved(done: asyncio.Future[Any]) -> None:
    """Mark a worker's error seen: a stream left early never awaits it."""
    if not done.cancelled():
        done.exception()
