"""Iterative retrieval-augmented generation (In-Context RaLM), naive or speculative.

Every ``stride`` generated tokens the last ``query_tokens`` tokens of question + output become a
query; the top-``k`` passages replace the ones in the prompt and generation goes on. With a
SpecRetriever the retrievals are guessed from a per-request cache and checked in batches (one
knowledge-base call each, optionally on a worker thread while the next stride generates); on
the first wrong guess generation rolls back to it. Decoding is greedy and the KV-cache history
is replayed exactly, so the output equals the naive loop's token for token.
"""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rag_spec.drafters.drafter import DraftSession
from rag_spec.engine.decoder import LookaheadDecoder
from rag_spec.errors import RagSpecError
from rag_spec.models.loader import LoadedModel
from rag_spec.prompts import chat_input_ids, rag_messages
from rag_spec.retrieval.os3 import StrideScheduler
from rag_spec.retrieval.spec_retriever import SpecRetriever, SpecSession, same_passages
from rag_spec.retrieval.types import Hit, Retriever
from rag_spec.serving.ralm_state import Extend, RalmState, Segment
from rag_spec.serving.served_model import ServedModel, ServedState
from rag_spec.speculation import Cancel, Speculation, SpeculationTally, speculate
from rag_spec.threads import use_one_openmp_thread
from rag_spec.tokenizing import serial


@dataclass(frozen=True)
class RaLMSpeculation:
    """How speculative iterative RaLM guesses and verifies (used where the retriever is a
    SpecRetriever; ``KNNSpeculation`` is kNN-LM's).

    Args:
        os3: pick each speculation stride with OS3 from measured stride, call and guess
            latencies and the hit rate (else ``stride``).
        asynchronous: verify on a worker thread while the next stride generates.
        stride: retrieval points guessed per verification when ``os3`` is off.
        max_stride: OS3's longest stride.
        max_in_flight: rounds under asynchronous verification at once. Behind a service whose
            calls mostly wait (a remote vector store), a second round in flight hides a call
            that takes longer than a stride; 1 keeps one call at a time.
    """

    os3: bool = True
    asynchronous: bool = True
    stride: int = 3
    max_stride: int = 8
    max_in_flight: int = 2


# the keywords IterativeRaLM took before RaLMSpeculation, and the fields they set
_LEGACY = {"os3": "os3", "asynchronous": "asynchronous", "speculation_stride": "stride",
           "max_speculation_stride": "max_stride", "max_in_flight": "max_in_flight"}


@dataclass
class RalmStats(SpeculationTally):
    """What the knowledge base was asked and where the time went (and, speculating, what the
    loop guessed: ``SpeculationTally``)."""

    kb_calls: int = 0
    queries_verified: int = 0
    rollback_points: list[int] = field(default_factory=list)  # output length at each rollback
    retrieval_seconds: float = 0.0  # inside knowledge-base calls
    generation_seconds: float = 0.0  # prefills and decoding (served: waiting for the strides)
    # a served model's: prompt tokens its strides sent, all of which a server without a prefix
    # cache processes again, and of them those the server said it read from its prefix cache
    served_prompt_tokens: int = 0
    served_cached_tokens: int = 0
    # a served model's strides closed mid-stream, a wrong guess behind them found meanwhile
    served_cancelled_strides: int = 0


@dataclass
class RalmResult:
    text: str
    token_ids: list[int]
    passages: list[Hit]  # the passages in the prompt when generation ended
    stats: RalmStats


_STATS_LOCK = threading.Lock()


@dataclass
class _Pending:
    """A retrieval point whose passages were guessed, not yet verified."""

    point: int
    length: int  # output length at the point
    query: str
    guess: list[Hit] | None  # None: not guessed, verified before use


class IterativeRaLM:
    """Retrieve every ``stride`` tokens; speculate when ``retriever`` is a SpecRetriever.

    Args:
        lm: a loaded model (``rag_spec.load_model``), or a model behind a server
            (``ServedModel``: each stride a request, the same tokens).
        retriever: any Retriever (naive loop) or a SpecRetriever (speculative loop).
        stride: tokens generated between retrievals.
        query_tokens: how many of the latest question + output tokens form a query.
        k: passages per retrieval, all placed in the prompt.
        speculation: how retrieval is speculated where ``retriever`` is a SpecRetriever
            (``RaLMSpeculation``; the earlier keywords ``os3``, ``asynchronous``,
            ``speculation_stride``, ``max_speculation_stride`` and ``max_in_flight`` still set
            its fields, with a DeprecationWarning).
        lookahead: a LookaheadDecoder on the same model: each stride is decoded speculatively
            too, drafting from the question, the passages seen and the output, on the
            decoder's weights: the tokens of their one-token decoding, retrieval speculated or
            not. Without it the loop decodes the model's own (float32) weights, one token a
            step; on a model loaded from a GGUF file the decoder's default weights are the
            file's, so for the same tokens as that, give it ``LookaheadConfig(quantized=False)``.

    The stride scheduler's measurements (stride, call and guess latencies, hit rate) carry over
    from one request to the next, so only the first request starts cold at stride 1.
    """

    # what knowledge-base calls and cache guesses are timed with, on the thread that makes them
    # (simulations and tests put a clock of their own here)
    clock: Callable[[], float] = staticmethod(time.perf_counter)

    def __init__(self, lm: LoadedModel | ServedModel, retriever: Retriever, *, stride: int = 4,
                 query_tokens: int = 32, k: int = 1,
                 speculation: RaLMSpeculation = RaLMSpeculation(),  # noqa: B008 (frozen)
                 lookahead: LookaheadDecoder | None = None, **legacy: Any) -> None:
        speculation = _with_legacy(speculation, legacy)
        if lookahead is not None and isinstance(lm, ServedModel):
            msg = ("A served model decodes on the server (rag-spec serve drafts there): "
                   "IterativeRaLM(ServedModel(...), retriever) takes no lookahead decoder.")
            raise RagSpecError(msg)
        if lookahead is not None and lookahead.model is not lm.model:
            msg = ("IterativeRaLM(lookahead=...) needs a LookaheadDecoder on the loop's own model: "
                   "LookaheadDecoder(lm.model, lm.tokenizer).")
            raise RagSpecError(msg)
        for name, value in (("stride", stride), ("query_tokens", query_tokens), ("k", k),
                            ("speculation.stride", speculation.stride),
                            ("speculation.max_in_flight", speculation.max_in_flight)):
            if value < 1:
                msg = f"{name} must be at least 1 (got {value})."
                raise RagSpecError(msg)
        self.lm = lm
        self.retriever = retriever
        self.stride = stride
        self.query_tokens = query_tokens
        self.k = k
        self.speculation = speculation
        self.lookahead = lookahead
        self._tokens = serial(lm.tokenizer)  # guesses and verifications run on several threads
        self._learned: StrideScheduler | None = None  # the latest request's, finished
        self._learned_lock = threading.Lock()

    def generate(self, question: str, max_new_tokens: int = 128) -> RalmResult:
        """Answer ``question``; the same tokens whether or not retrieval is speculative."""
        if not question.strip():
            msg = "The question is empty; IterativeRaLM needs something to retrieve for."
            raise RagSpecError(msg)
        if max_new_tokens < 1:
            msg = f"max_new_tokens must be at least 1 (got {max_new_tokens})."
            raise RagSpecError(msg)
        tokenizer = self._tokens
        question_ids = tokenizer(question, add_special_tokens=False)["input_ids"]
        session, extend = self._drafting(question) if self.lookahead else (None, None)
        state = self._state(lambda hits: chat_input_ids(tokenizer, rag_messages(question, hits)),
                            extend)
        stats = RalmStats()
        with torch.inference_mode():
            if isinstance(self.retriever, SpecRetriever):
                self._speculative(state, self.retriever.session(), question, question_ids,
                                  max_new_tokens, stats)
            else:
                self._naive(state, question, question_ids, max_new_tokens, stats)
        if session is not None:
            session.finish(state.output)
        stats.generation_seconds = state.compute_seconds
        if isinstance(state, ServedState):
            stats.served_prompt_tokens = state.prompt_tokens
            stats.served_cached_tokens = state.cached_tokens
            stats.served_cancelled_strides = state.cancelled_strides
        text = tokenizer.decode(state.output, skip_special_tokens=True)
        return RalmResult(text, list(state.output), state.passages, stats)

    def _state(self, build_prompt: Any, extend: Extend | None) -> RalmState | ServedState:
        """A request's generation state: caches here, or on the server."""
        if isinstance(self.lm, ServedModel):
            return ServedState(self.lm, build_prompt, self.lm.eos_token_ids)
        eos = self.lm.model.generation_config.eos_token_id
        return RalmState(self.lm.model, build_prompt,
                         eos if isinstance(eos, list) else [eos] if eos is not None else [],
                         extend, self.lookahead.fill if self.lookahead else None)

    def _drafting(self, question: str) -> tuple[DraftSession, Extend]:
        """A draft session for this request and the RalmState hook that decodes with it."""
        decoder, tokenizer = self.lookahead, self._tokens
        if decoder is None:
            msg = "drafting needs the loop's lookahead decoder"
            raise ValueError(msg)
        # The session starts from the question's prompt; its passages come in as each segment
        # retrieves them. Drafters read the segment's own sequence: the tokens its cache holds.
        base = chat_input_ids(tokenizer, rag_messages(question, []))
        session = decoder.drafter.session(base)  # rows draft one by one: no batch cache
        policy = decoder.segment_policy()
        seen: set[int] = set()

        def extend(segment: Segment, output: list[int], n: int) -> list[int]:
            new = [hit for hit in segment.passages if hit.doc_id not in seen]
            if new:
                session.add_documents(tokenizer([h.text for h in new],
                                                add_special_tokens=False)["input_ids"])
                seen.update(hit.doc_id for hit in new)
            return decoder.extend(segment.cache, segment.prompt + output, n, session,
                                  policy).token_ids

        return session, extend

    def _query(self, question_ids: list[int], output: list[int]) -> str:
        tail = (question_ids + output)[-self.query_tokens:]
        text = self._tokens.decode(tail, skip_special_tokens=True)
        if text.strip():
            return text
        # output of whitespace alone: knowledge bases refuse a blank query, so the question
        return self._tokens.decode(question_ids, skip_special_tokens=True)

    def _search(self, search: Any, queries: list[str], stats: RalmStats
                ) -> tuple[list[list[Hit]], float]:
        """One knowledge-base call through ``search``, counted; its hits and its own latency
        (each round in flight is timed by itself)."""
        started = self.clock()
        hits = search(queries, self.k)
        elapsed = self.clock() - started
        with _STATS_LOCK:  # rounds in flight finish on different workers
            stats.retrieval_seconds += elapsed
            stats.kb_calls += 1
            stats.queries_verified += len(queries)
        return hits, elapsed

    def _generate(self, state: RalmState | ServedState, limit: int,
                  cancel: Cancel | None = None) -> None:
        state.step(min(self.stride, limit - len(state.output)), cancel)

    def _naive(self, state: RalmState | ServedState, question: str, question_ids: list[int],
               limit: int, stats: RalmStats) -> None:
        state.use(self._search(self.retriever.search, [question], stats)[0][0], -1)
        point = 0
        while True:
            self._generate(state, limit)
            if state.finished or len(state.output) >= limit:
                return
            query = self._query(question_ids, state.output)
            state.use(self._search(self.retriever.search, [query], stats)[0][0], point)
            point += 1

    def _speculative(self, state: RalmState | ServedState, session: SpecSession, question: str,
                     question_ids: list[int], limit: int, stats: RalmStats) -> None:
        scheduler = self._scheduler()
        try:
            self._speculate(state, session, question, question_ids, limit, stats, scheduler)
        finally:
            with self._learned_lock:
                self._learned = scheduler

    def _scheduler(self) -> StrideScheduler:
        """A scheduler with this loop's settings and the previous request's measurements."""
        spec = self.speculation
        scheduler = StrideScheduler(os3=spec.os3, fixed=spec.stride,
                                    asynchronous=spec.asynchronous, max_stride=spec.max_stride)
        with self._learned_lock:
            if self._learned is not None:
                scheduler.resume(self._learned)
        return scheduler

    def _speculate(self, state: RalmState | ServedState, session: SpecSession, question: str,
                   question_ids: list[int], limit: int, stats: RalmStats,
                   scheduler: StrideScheduler) -> None:
        state.use(self._verify(session, [question], stats, scheduler)[0][0], -1)
        speculate(_Guesses(self, state, session, question_ids, limit, stats, scheduler),
                  scheduler, stats, max_in_flight=self.speculation.max_in_flight,
                  initializer=use_one_openmp_thread)

    def _verify(self, session: SpecSession, queries: list[str], stats: RalmStats,
                scheduler: StrideScheduler | None = None) -> tuple[list[list[Hit]], float]:
        """One knowledge-base call, its truths and latency; given the ``scheduler``, it runs in
        the foreground and its CPU share is measured (a worker's would include the decoding
        running beside it)."""
        cpu = time.process_time()
        truths, seconds = self._search(session.verify, queries, stats)
        if scheduler is not None:
            scheduler.record_cpu_share(time.process_time() - cpu, seconds)
        return truths, seconds


def _with_legacy(speculation: RaLMSpeculation, legacy: dict[str, Any]) -> RaLMSpeculation:
    """``speculation`` with the fields IterativeRaLM's earlier keywords set (warned)."""
    unknown = sorted(set(legacy) - set(_LEGACY))
    if unknown:
        msg = f"IterativeRaLM got unexpected keyword arguments: {', '.join(unknown)}."
        raise TypeError(msg)
    if not legacy:
        return speculation
    fields = ", ".join(f"{_LEGACY[name]}={value!r}" for name, value in legacy.items())
    warnings.warn(f"IterativeRaLM's speculation settings are one object now: pass "
                  f"speculation=RaLMSpeculation({fields}).", DeprecationWarning, stacklevel=3)
    return replace(speculation, **{_LEGACY[name]: value for name, value in legacy.items()})


class _Guesses(Speculation[_Pending, list[Hit]]):
    """Iterative RaLM on the speculation loop: a point is a stride's end, its guess the
    passages the session's cache ranks first for the query there. A stride stops early once a
    wrong guess behind it is found: a served one closes its stream, one decoded token by token
    here stops between tokens."""

    cancellable = True

    def __init__(self, loop: IterativeRaLM, state: RalmState | ServedState, session: SpecSession,
                 question_ids: list[int], limit: int, stats: RalmStats,
                 scheduler: StrideScheduler) -> None:
        self.loop, self.state, self.session = loop, state, session
        self.question_ids, self.limit = question_ids, limit
        self.stats, self.scheduler = stats, scheduler
        self.point = 0  # the next retrieval point's number

    def advance(self, cancel: Cancel) -> tuple[_Pending | None, bool]:
        state = self.state
        self.loop._generate(state, self.limit, cancel)
        if cancel.is_set():  # rolled back to a wrong guess behind this stride: no point here
            return None, False
        if state.finished or len(state.output) >= self.limit:
            return None, True
        query = self.loop._query(self.question_ids, state.output)
        guess = None  # no guess: asking the knowledge base costs no more
        if self.scheduler.worth_guessing():
            guessed = self.loop.clock()
            guess = self.session.guess(query, self.loop.k)
            self.scheduler.record_guess(self.loop.clock() - guessed)
        self.point += 1
        return _Pending(self.point - 1, len(state.output), query, guess), False

    def guessed(self, point: _Pending) -> bool:
        return point.guess is not None

    def go_on(self, point: _Pending, truth: list[Hit] | None) -> None:
        passages = truth if truth is not None else point.guess
        assert passages is not None
        self.state.use(passages, point.point)

    def verify(self, points: Sequence[_Pending], foreground: bool
               ) -> tuple[list[list[Hit]], float]:
        return self.loop._verify(self.session, [p.query for p in points], self.stats,
                                 self.scheduler if foreground else None)

    def right(self, point: _Pending, truth: list[Hit]) -> bool:
        return point.guess is not None and same_passages(point.guess, truth)

    def roll_back(self, point: _Pending, truth: list[Hit]) -> None:
        self.stats.rollback_points.append(point.length)
        self.state.rollback(point.point, point.length)
        self.state.use(truth, point.point)
        self.point = point.point + 1

    def confirmed(self, points: Sequence[_Pending]) -> None:
        self.state.forget_before(points[-1].point)
