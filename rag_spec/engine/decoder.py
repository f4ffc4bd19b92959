"""The lossless speculative decode loop: draft a token tree, verify it in one forward pass,
keep the longest path the model agrees with plus one bonus token, compact the KV cache.
"""

from __future__ import annotations

import functools
import threading
import time
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import MappingProxyType
from typing import Any, Literal

import torch

from rag_spec.drafters.defaults import default_drafter
from rag_spec.drafters.drafter import Drafter, DraftSession, TargetView, check_drafter
from rag_spec.drafters.trie_drafter import TrieConfig
from rag_spec.engine.batch import (
    GenerationResult,
    LiveBatch,
    Row,
    speculative_step,
)
from rag_spec.engine.stopping import StopRule
from rag_spec.engine.streaming import TextStream
from rag_spec.engine.verify.grammar import Constraint, Grammars, row_requests
from rag_spec.errors import IncompleteOutputWarning, RagSpecError
from rag_spec.models.limits import context_window
from rag_spec.policy.plan import Policy, RowPolicy
from rag_spec.progress import progress as progress_bar
from rag_spec.target.sampling import RowSampler, SamplingParams
from rag_spec.target.transformers.kv_cache import attention_window, crop
from rag_spec.target.transformers.prefill import append
from rag_spec.target.transformers.prefix_store import PrefixStore
from rag_spec.target.transformers.runner import Runner, RunnerSettings
from rag_spec.target.transformers.tree_cache import TreeKVCache
from rag_spec.tokenizing import serial


@dataclass(frozen=True)
class LookaheadConfig:
    """The decoder's knobs; the defaults suit RAG answers on a CPU.

    Engine: ``budget``. Default trie drafter: ``branch_length``, ``memory_mb`` (``.trie``).
    Kernels: ``onednn_linear``, ``exact``, ``compile``, ``quantized`` (``.runner``). What the
    benches switch off to measure what each part buys (sizing, rag-spec's CPU attention, the
    streamed products) is no setting of a user's: ``ablated`` builds such a decoder.
    """

    budget: int = 12  # most draft nodes verified per step
    branch_length: int = 8  # longest drafted continuation
    memory_mb: float = 64.0  # bound on the trie's memory of earlier outputs
    # CPU: oneDNN matrix products on a reordered weight copy (cheap tree steps). "auto": only
    # while the copy fits a quarter of the available memory; True forces it, False turns it off.
    onednn_linear: bool | Literal["auto"] = "auto"
    # every token of a step computed bit for bit as a one-token step, so output equals
    # ``generate``'s in half precision too (slower steps). "auto": for bfloat16 / float16
    # models (with SDPA attention), on a CPU or a GPU; False: the fast kernels, whose rounding
    # differs from a one-token step's (in half precision that changes tokens where logits tie)
    exact: bool | Literal["auto"] = "auto"
    # steps compiled on a static KV cache (gpt-fast style; full attention, a batch's shorter
    # prompts left-padded). On a CPU every step, its products oneDNN's (one-token steps only
    # where oneDNN is off); on a GPU every step, as CUDA graphs. "auto": on a CPU, where this
    # machine holds the model's steps compiled ahead of time (``package_steps()``, ``rag-spec
    # models compile``; loaded in about a second), else eager: never compiles. True: that
    # package, or torch.compile at first use (minutes on a CPU; a GPU's CUDA graphs). Its
    # rounding is inductor's, so half precision keeps exact numerics under "auto" and needs
    # exact=False under True
    compile: bool | Literal["auto"] = "auto"
    # CPU, a model loaded from a GGUF file (``load_model("x.gguf")``, the embedded model):
    # its linear layers multiply by the file's own 4- and 8-bit weights (Q4_0, Q4_1, Q8_0,
    # Q4_K, Q6_K; other formats stay float32) in integer products on inputs rounded to 8 bits, as
    # llama.cpp's, and every step attends row by row (a tree's rows bit for bit one-token
    # steps'). Another model than the float32 one: greedy output equals this setting's own
    # no-draft decoding, not ``generate``'s. Compiled steps come from a package of their own
    # (``rag-spec models compile`` builds it for the embedded model). "auto": wherever it
    # applies (a float32 model on a CPU whose kernels run, loaded from a GGUF file, without
    # exact numerics), as measured faster there; True: required (an error says why it does
    # not apply); False: the de-quantised float32 weights, whose output equals ``generate``'s
    quantized: bool | Literal["auto"] = "auto"
    # bound on the prompts' KV entries the decoder keeps, so that a prompt that begins as an
    # earlier one did (a conversation's next turn, an agent's next step, a shared system
    # prompt) reads them instead of computing them again; only where that is lossless: the
    # GGUF weights' passes work row by row, so a token's entries are the same in any pass
    # (``DecodeStats.cached_prompt_tokens`` counts what was read). 0 turns it off
    prefix_cache_mb: float = 256.0

    @property
    def trie(self) -> TrieConfig:
        return TrieConfig(self.branch_length, memory_mb=self.memory_mb)

    @property
    def runner(self) -> RunnerSettings:
        return RunnerSettings(onednn_linear=self.onednn_linear, exact=self.exact,
                              compile=self.compile, quantized=self.quantized)


class GenerationStream:
    """Text pieces of one generation, produced as the caller iterates; ``result`` at the end."""

    def __init__(self, steps: Generator[None, None, list[GenerationResult]],
                 pieces: list[str]) -> None:
        self._steps = steps
        self._pieces = pieces  # filled by the decoder's text stream as steps settle text
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        try:
            while self.result is None:  # a finished stream yields nothing more
                try:
                    next(self._steps)
                except StopIteration as done:
                    if done.value is None:  # closed before the end
                        return
                    self.result = done.value[0]
                    warn_incomplete(done.value)
                yield from self._flush()
        finally:
            self.close()

    def close(self) -> None:
        """Stop generating (the decoder is free again)."""
        self._steps.close()

    def _flush(self) -> Iterator[str]:
        pieces, self._pieces[:] = list(self._pieces), []
        yield from pieces


def warn_incomplete(results: Sequence[GenerationResult], stacklevel: int = 3) -> None:
    """Warn the caller of ``generate`` or of a stream's iteration (two frames up, by
    default) of constrained answers that ended before their grammar was complete."""
    cut = sum(r.incomplete for r in results)
    if cut:
        msg = (f"{cut} of {len(results)} constrained answers (a JSON schema, a grammar, a "
               f"tool call) ended before their grammar was complete, at max_new_tokens or a "
               f"stop string: they are not valid under it (GenerationResult.incomplete). Raise "
               f"max_new_tokens (max_tokens in LangChain).")
        warnings.warn(msg, IncompleteOutputWarning, stacklevel=stacklevel)


def _drain(steps: Generator[None, None, list[GenerationResult]]) -> list[GenerationResult]:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class LookaheadDecoder:
    """Speculative decoding for any transformers causal LM, with plain decoding's exact output.

    The model is only read: forward passes go through a ``Runner``, a private copy of its
    module tree that shares the weights. Any ``Drafter`` can propose the trees (default: a
    trained draft head merged with the trie where one exists for the model, shipped or trained
    with ``rag-spec draft train --head``; else the trie drafter configured by ``config``;
    ``stats.drafts`` says which).

    Examples:
        >>> dec = LookaheadDecoder(lm.model, lm.tokenizer)               # doctest: +SKIP
        >>> dec.generate(ids, max_new_tokens=64).token_ids                # doctest: +SKIP
    """

    # what ``ablated`` switches off: sizing by measurements (False: every drafted node is
    # verified each step), and kernel settings (``RunnerSettings`` fields)
    _adaptive: bool = True
    _switched_off: Mapping[str, Any] = MappingProxyType({})

    def __init__(self, model: Any, tokenizer: Any = None, config: LookaheadConfig | None = None,
                 drafter: Drafter | None = None) -> None:
        _check_model(model)
        _check_vocabulary(model, tokenizer)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or LookaheadConfig()
        if drafter is not None:
            check_drafter(drafter)
        self.drafter: Drafter = drafter or default_drafter(model, self.config.trie)
        self._kernels = replace(self.config.runner, **self._switched_off)
        Runner.of(model, self._kernels)  # built now: the first generation stays fast
        self._window = attention_window(model.config)  # refuses attention it cannot mask
        self._tokens = serial(tokenizer)
        self._pending = threading.local()  # add_context documents, per calling thread
        self._lock = threading.Lock()  # one generation at a time (streams hold it between steps)
        # every sizing decision, and what carries over between requests
        self._policy = Policy(self.config.budget, adaptive=self._adaptive)
        self._prefixes: tuple[Runner, PrefixStore] | None = None  # the runner they came from

    @property
    def runner(self) -> Runner:
        """The fast path over the model as it is now (rebuilt if its modules were replaced)."""
        return Runner.of(self.model, self._kernels)

    def add_context(self, texts: Sequence[str]) -> None:
        """Documents the next ``generate`` call on this thread may copy from (e.g. retrieved
        passages)."""
        self._require_tokenizer("add_context")
        if not texts:  # nothing retrieved: nothing to copy from
            return
        documents = self._tokens(list(texts), add_special_tokens=False)["input_ids"]
        self._pending.__dict__.setdefault("documents", []).extend(documents)

    def generate(self, input_ids: Any, max_new_tokens: int = 128, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, stop: Sequence[str] = (),
                 streamer: Callable[[str], None] | Any = None,
                 attention_mask: Any = None, seed: int | None = None,
                 context: Sequence[str] = (), json_schema: Any = None, regex: Any = None,
                 grammar: Any = None, choices: Any = None,
                 ) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` after each prompt.

        Args:
            input_ids: one prompt (list of ids, 1-D tensor, or [1, T] tensor) or a batch (list of
                lists, or [B, T] tensor with ``attention_mask`` for padding).
            stop: strings that end generation; the text is cut before them.
            streamer: receives each settled piece of text (a callable), or token ids (a
                transformers streamer); single prompts only.
            seed: fixes sampled output (default: drawn from torch's RNG; row ``b`` of a batch
                samples with ``seed + b``): whatever the drafts where they are not drawn (the
                trie); for drafts drawn from a model, given the drafter's state (a merged
                drafter's trie learns from earlier outputs). The distribution is plain
                sampling's either way. Greedy decoding draws nothing.
            context: documents this call may copy from, like ``add_context`` but for this call
                only.
            json_schema: a JSON schema the output follows (a dict, a JSON string or a
                Pydantic model class): at most one whitespace character at each place JSON
                allows some (xgrammar's ``compile_json_schema(schema,
                max_whitespace_cnt=1)``); wrap it as ``JsonSchema(schema, whitespace=0)`` for
                compact JSON, ``JsonSchema(schema, indent=2)`` for JSON over lines. At most
                one of the four grammar keywords per prompt; a list gives one per prompt of a
                batch. The tokens are constrained decoding's on the same grammar: greedy picks
                the argmax of the allowed tokens' logits, sampling draws from the allowed
                tokens.
            regex: a regular expression the output matches.
            grammar: an EBNF grammar the output follows (start rule ``root``).
            choices: a list of the strings the output is one of (a bare string is refused).

        Returns:
            A GenerationResult for a single prompt, a list of them for a batch. A constrained
            answer that ended before its grammar was complete (at ``max_new_tokens``) has
            ``incomplete`` set, and the call warns (``IncompleteOutputWarning``).
        """
        prompts, single = _prompts(input_ids, attention_mask)
        if streamer is not None and len(prompts) > 1:
            msg = "A streamer follows one prompt; call generate once per prompt to stream each."
            raise RagSpecError(msg)
        steps = self._steps(prompts, max_new_tokens, SamplingParams(
            do_sample, temperature, top_k, top_p, repetition_penalty), stop, seed, context,
            streamer, json_schema=json_schema, regex=regex, grammar=grammar, choices=choices)
        results = _drain(steps)
        warn_incomplete(results)
        return results[0] if single else results

    def stream(self, input_ids: Any, max_new_tokens: int = 128, **options: Any
               ) -> GenerationStream:
        """Generate for one prompt on the caller's thread, yielding text as it settles.

        Takes ``generate``'s options (except ``streamer``). Iterate the returned stream for text
        pieces (they join to the final text); its ``result`` is set once it is exhausted.
        Closing the stream early stops the generation at the current step.

        Examples:
            >>> stream = decoder.stream(ids, max_new_tokens=64)            # doctest: +SKIP
            >>> for piece in stream: print(piece, end="")                  # doctest: +SKIP
            >>> stream.result.stats.tokens_per_step                        # doctest: +SKIP
        """
        prompts, _ = _prompts(input_ids, options.pop("attention_mask", None))
        if len(prompts) > 1:
            msg = "stream follows one prompt; use generate for a batch."
            raise RagSpecError(msg)
        params = SamplingParams(options.pop("do_sample", False), options.pop("temperature", 1.0),
                                options.pop("top_k", 0), options.pop("top_p", 1.0),
                                options.pop("repetition_penalty", 1.0))
        pieces: list[str] = []
        return GenerationStream(self._steps(
            prompts, max_new_tokens, params, options.pop("stop", ()), options.pop("seed", None),
            options.pop("context", ()), pieces.append, **options), pieces)

    def _steps(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
               stop: Sequence[str], seed: int | None, context: Sequence[str],
               streamer: Callable[[str], None] | Any = None, **grammars: Any,
               ) -> Generator[None, None, list[GenerationResult]]:
        """The whole generation as a generator: one ``yield`` per decoding step, holding the
        decoder meanwhile; returns the results."""
        batch = self.open_batch(greedy=not params.do_sample)
        try:
            rows = self._rows(prompts, max_new_tokens, params, stop, seed, context, streamer,
                              **grammars)
            batch.join(rows)
            if batch.runner.exact:  # the first tokens came with the prefill
                yield
            while batch.live:
                batch.step()
                yield
        finally:
            batch.close()
        return [r.result() for r in rows]

    def open_batch(self, *, greedy: bool = True) -> LiveBatch:
        """A batch that rows join between steps (continuous batching): ``new_rows`` makes
        them, ``LiveBatch.join`` adds them, ``LiveBatch.step`` decodes one step, ``close`` ends
        it. It holds the decoder until closed (``generate`` and ``stream`` wait); ``greedy``:
        the kind of rows it takes (sampled rows are planned otherwise)."""
        self._lock.acquire()
        try:
            runner = self.runner
            return LiveBatch(runner, self.drafter, self._policy, self.config.budget,
                             self._window, greedy=greedy, release=self._lock.release,
                             prefixes=self._prefix_store(runner))
        except BaseException:
            self._lock.release()
            raise

    def _prefix_store(self, runner: Runner) -> PrefixStore | None:
        """The prompts' stored entries for ``runner`` (a new store if the runner was
        rebuilt); None where reading them would not be lossless, or they are turned off."""
        if not (runner.row_invariant and self.config.prefix_cache_mb > 0
                and self._window is None):
            return None
        if self._prefixes is None or self._prefixes[0] is not runner:
            self._prefixes = (runner, PrefixStore(int(self.config.prefix_cache_mb * 2**20)))
        return self._prefixes[1]

    def new_rows(self, input_ids: Any, max_new_tokens: int = 128, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, stop: Sequence[str] = (),
                 seed: int | None = None, context: Sequence[str] = (),
                 streamer: Callable[[str], None] | Any = None, **grammars: Any) -> list[Row]:
        """Rows of an open batch (``open_batch``) for each prompt, with ``generate``'s options
        (and its checks: a bad one is a RagSpecError); ``streamer`` follows the first. Call
        it while holding the batch: drafting sessions are made here."""
        prompts, _ = _prompts(input_ids, grammars.pop("attention_mask", None))
        return self._rows(prompts, max_new_tokens, SamplingParams(
            do_sample, temperature, top_k, top_p, repetition_penalty), stop, seed, context,
            streamer, **grammars)

    def _rows(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
              stop: Sequence[str], seed: int | None, context: Sequence[str],
              streamer: Callable[[str], None] | Any = None, *, json_schema: Any = None,
              regex: Any = None, grammar: Any = None, choices: Any = None) -> list[Row]:
        if max_new_tokens <= 0:
            msg = f"max_new_tokens must be at least 1 (got {max_new_tokens})."
            raise RagSpecError(msg)
        stop = [stop] if isinstance(stop, str) else list(stop)
        if stop:
            self._require_tokenizer("stop strings")
            if not all(isinstance(s, str) and s for s in stop):
                msg = (f"stop takes a list of non-empty strings (got {stop!r}); an empty string "
                       f"would end every answer before it starts.")
                raise RagSpecError(msg)
        if context:
            self._require_tokenizer("context documents")
        documents = self._tokens(list(context), add_special_tokens=False)["input_ids"] \
            if context else []
        documents = self._pending.__dict__.pop("documents", []) + documents
        self._check_length(prompts)
        _check_ids(prompts, self.model.get_input_embeddings().num_embeddings)
        constraints = self._constraints(len(prompts), json_schema=json_schema, regex=regex,
                                        grammar=grammar, choices=choices)
        if params.do_sample and seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())  # torch.manual_seed still governs
        greedy = not params.do_sample
        rows = [Row(p, self.drafter.session(p, documents),
                    self._policy.row(greedy=greedy, steady=self._steady),
                    RowSampler(params, None if seed is None else seed + b),
                    StopRule(self._tokens, self._eos_ids(), stop,
                             self._max_new(p, max_new_tokens)),
                    constraint=constraints[b])
                for b, p in enumerate(prompts)]
        if streamer is not None:
            rows[0].stream = TextStream(streamer, rows[0].rule, prompts[0])
        return rows

    def _constraints(self, rows: int, **grammars: Any) -> list[Constraint | None]:
        """Each row's grammar, compiled before any decoding (a bad one is a RagSpecError)."""
        requests = row_requests(rows, **grammars)
        if not any(r.given for r in requests):
            return [None] * rows
        self._require_tokenizer("constrained output")
        vocab = self.model.get_input_embeddings().num_embeddings
        compiler = Grammars.of(self.tokenizer, vocab, self._eos_ids())
        return [Constraint(compiler.compile(r), vocab, self._tokens) if r.given else None
                for r in requests]

    def forget_prefixes(self) -> int:
        """Drop the stored prompt entries (``LookaheadConfig.prefix_cache_mb``): the next
        prompts compute all of theirs, as a cold server's would (benchmarks measure from
        there). Returns how many prompts were stored. Thread-safe."""
        if self._prefixes is None:
            return 0
        store = self._prefixes[1]
        stored = len(store)
        store.clear()
        return stored

    def warm_up(self, max_new_tokens: int = 16, *, progress: bool = True) -> float:
        """Pay a first request's one-time costs now, before a service takes traffic: with
        ``compile=True`` and no package of steps compiled ahead of time, the steps'
        compilation (minutes on a CPU, where ``package_steps`` compiles them once per machine
        instead; a GPU's CUDA graphs), otherwise the kernels' first-use set-up. Returns the
        seconds it took.

        Made-up prompts run through this decoder's runner twice, drafting nothing (prefill and
        one-token passes) and then drafting from the prompt (tree passes), on a private trie:
        this decoder's drafter learns nothing from them. A batch of several prompts compiles
        its own graphs at first use. Not in the background: compiling holds Python's
        interpreter lock for most of a minute, and on two cores eager steps on another
        thread slowed more than tenfold while it ran.
        """
        started = time.perf_counter()
        vocab = self.model.get_input_embeddings().num_embeddings
        for budget in progress_bar((0, self.config.budget), "warming up decoding steps",
                                   "pass", enabled=progress):
            decoder = LookaheadDecoder(self.model, config=replace(self.config, budget=budget))
            for attempt in range(3):  # a prompt whose answer ends at once runs no steps
                # mid-vocabulary, clear of the special ids most tokenizers put first
                prompt = [(vocab // 2 + 8 * attempt + i) % vocab for i in range(8)] * 8
                if decoder.generate(prompt, max_new_tokens).finish_reason == "length":
                    break
        return time.perf_counter() - started

    def package_steps(self, *, progress: bool = True) -> Path:
        """Compile this decoder's steps ahead of time, once per model architecture, dtype and
        machine (~3 minutes on two cores for the embedded model), and decode through them from
        now on; returns the package's folder. Every later process loads it in about a second
        (``compile="auto"``, the default). Not in the background, as ``warm_up``."""
        with self._lock:
            return self.runner.package_steps(progress)

    def extend(self, cache: Any, context: list[int], max_new_tokens: int, session: DraftSession,
               policy: RowPolicy) -> GenerationResult:
        """Greedy tokens after ``context`` for a caller that manages its own KV cache.

        Iterative RaLM keeps one cache per passage and decodes a few tokens at a time; this
        lets it verify drafts too. ``context`` is the whole sequence: ``cache`` (from
        ``kv_cache.new_cache``, one row) holds every position of it but the last token, so
        drafters read what ``generate`` hands them (a token's index is its position). On
        return the cache holds the sequence up to, not including, the last new token, so
        consecutive calls chain. The session and the estimates (``segment_policy``) persist
        across calls; nothing is remembered across requests (call ``session.finish`` at the
        end).
        """
        tree_cache = TreeKVCache.of_row(cache, context[-1], self._window)
        length = tree_cache.length
        if length != len(context) - 1:
            msg = (f"extend's cache holds {length} positions but its context has "
                   f"{len(context)} tokens: pass the whole sequence the cache holds, plus the "
                   "pending last token.")
            raise ValueError(msg)
        row = Row(list(context), session, policy, RowSampler(SamplingParams()),
                  StopRule(self._tokens, self._eos_ids(), (), max_new_tokens), remember=False)
        target = TargetView(self.runner, tree_cache)
        declared = self.drafter.capabilities
        planner = self._policy.segment_planner(chain=declared.chain,
                                               chain_probes=declared.chain_probes)
        with self._lock:
            self.drafter.begin(target)
            try:
                while row.finish_reason is None:
                    speculative_step([row], target, planner, self.drafter,
                                     self.config.budget)
            finally:
                self.drafter.end(target)
        crop(cache, length + len(row.output))  # a cut-short last step may have kept more
        return GenerationResult(row.output, "", row.finish_reason or "length", row.stats)

    def fill(self, cache: Any, tokens: list[int]) -> None:
        """Append ``tokens`` to a one-row cache the caller manages (``extend``'s prefill), on
        the same fast path as the steps that follow."""
        with self._lock:
            append(self.runner, cache, tokens)

    def segment_policy(self) -> RowPolicy:
        """Estimates for a loop that calls ``extend`` segment by segment (iterative RaLM): one
        per request, carried across its segments."""
        return self._policy.segment()

    @property
    def _steady(self) -> bool:
        """Whether the drafter's hits are steady, not in runs (``budget.STEADY_SMOOTHING``)."""
        return self.drafter.capabilities.steady

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _max_new(self, prompt: list[int], max_new_tokens: int) -> int:
        window = context_window(self.model.config, self.tokenizer)
        return max_new_tokens if window is None else min(max_new_tokens, window - len(prompt))

    def _check_length(self, prompts: list[list[int]]) -> None:
        window = context_window(self.model.config, self.tokenizer)
        longest = max(len(p) for p in prompts)
        if window is not None and longest >= window:
            msg = (f"The prompt is {longest} tokens but the model's context window is {window}; "
                   f"shorten the prompt (fewer or shorter retrieved passages).")
            raise RagSpecError(msg)

    def _require_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            msg = f"{what} needs a tokenizer: LookaheadDecoder(model, tokenizer)."
            raise RagSpecError(msg)


def _prompts(input_ids: Any, attention_mask: Any) -> tuple[list[list[int]], bool]:
    """Normalise the accepted prompt forms to lists of ids; also say whether it was one prompt."""
    if isinstance(input_ids, torch.Tensor):
        single = input_ids.dim() == 1
        batch = input_ids.reshape(1, -1) if single else input_ids
        if attention_mask is not None:
            mask = torch.as_tensor(attention_mask).reshape(batch.shape).bool()
            prompts = [row[m].tolist() for row, m in zip(batch, mask)]
        else:
            prompts = batch.tolist()
        single = single or batch.shape[0] == 1
    else:
        seq = list(input_ids)
        single = not seq or not isinstance(seq[0], (list, tuple))
        prompts = [list(map(int, seq))] if single else [list(map(int, p)) for p in seq]
    if not prompts or any(len(p) == 0 for p in prompts):
        msg = "The prompt is empty: give at least one token (e.g. the chat template's output)."
        raise RagSpecError(msg)
    return prompts, single


def _check_ids(prompts: list[list[int]], vocab: int) -> None:
    """Token ids the model has an embedding for: others would fail deep inside torch."""
    bad = next((t for p in prompts for t in p if not 0 <= t < vocab), None)
    if bad is not None:
        msg = (f"Token id {bad} is outside the model's vocabulary (0 to {vocab - 1}): encode "
               f"the prompt with the model's own tokenizer.")
        raise RagSpecError(msg)


# Models pad their embedding tables past the tokenizer (to a multiple of 64 to 1024 rows);
# a larger gap means the tokenizer is another model's.
_PADDING = 1024


def _check_vocabulary(model: Any, tokenizer: Any) -> None:
    """Refuse a tokenizer of another vocabulary: its ids would mean other tokens to the model,
    and the model's ids would decode to nothing."""
    if tokenizer is None:
        return
    try:
        words = len(tokenizer)
    except TypeError:  # a wrapper without __len__: its vocabulary size, added tokens aside
        words = getattr(tokenizer, "vocab_size", None)
    if not isinstance(words, int):
        return
    rows = model.get_input_embeddings().num_embeddings
    if not words <= rows <= words + _PADDING:
        msg = (f"The tokenizer has {words} tokens but the model {rows} embeddings: it belongs "
               f"to another model. Load the tokenizer from the model's own folder "
               f"(AutoTokenizer.from_pretrained(<the model's folder>)).")
        raise RagSpecError(msg)
    folder = getattr(model, "name_or_path", "") or ""
    saved = _saved_vocabulary(folder)
    if saved is None or not callable(getattr(tokenizer, "get_vocab", None)):
        return
    given = tokenizer.get_vocab()
    ids = [(index, given.get(piece)) for piece, index in saved.items()]
    moved = sum(other is not None and other != index for index, other in ids)
    missing = sum(other is None for _, other in ids)  # spelled otherwise, or another vocabulary
    if moved or missing > len(saved) // 2:
        msg = (f"The tokenizer's vocabulary is not the one saved with the model ({folder}): "
               f"{moved + missing} of its {len(saved)} pieces have other ids or none, so the "
               f"model would read other tokens than were meant. Load the tokenizer from the "
               f"model's own folder (AutoTokenizer.from_pretrained({folder!r})).")
        raise RagSpecError(msg)


def _saved_vocabulary(folder: str) -> Mapping[str, int] | None:
    """Piece -> id of the tokenizer saved beside a model (its folder's ``tokenizer.json``);
    None where there is none."""
    path = Path(folder) / "tokenizer.json" if folder else None
    if path is None or not path.is_file():
        return None
    stat = path.stat()
    return _vocabulary_file(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _vocabulary_file(path: str, mtime_ns: int, size: int) -> Mapping[str, int]:
    """A tokenizer file's vocabulary, read once per version of the file (read only)."""
    from tokenizers import Tokenizer

    return MappingProxyType(Tokenizer.from_file(path).get_vocab(with_added_tokens=True))


def _check_model(model: Any) -> None:
    config = getattr(model, "config", None)
    if config is None or not callable(model):
        msg = "LookaheadDecoder needs a transformers causal LM (e.g. AutoModelForCausalLM)."
        raise RagSpecError(msg)
    if getattr(config, "is_encoder_decoder", False):
        msg = (f"{type(model).__name__} is an encoder-decoder model; rag-spec decodes "
               f"decoder-only causal LMs (Llama, Qwen2, Mistral, SmolLM2, ...).")
        raise RagSpecError(msg)


def ablated(model: Any, tokenizer: Any = None, config: LookaheadConfig | None = None,
            drafter: Drafter | None = None, *, adaptive: bool = True, **kernels: Any
            ) -> LookaheadDecoder:
    """A decoder with parts switched off, for the benches and tests that measure what each part
    buys (no user's setting, so not exported): ``adaptive=False`` verifies every drafted node
    each step instead of sizing trees by measurements; ``kernels`` are ``RunnerSettings``
    fields (``cpu_attention=False``: SDPA; ``streamed_linear=False``: oneDNN's products)."""
    unknown = set(kernels) - set(RunnerSettings.__dataclass_fields__)
    if unknown:
        msg = f"ablated() takes RunnerSettings fields, not {sorted(unknown)}"
        raise TypeError(msg)
    return _Ablated(model, tokenizer, config, drafter, adaptive, kernels)


class _Ablated(LookaheadDecoder):
    def __init__(self, model: Any, tokenizer: Any, config: LookaheadConfig | None,
                 drafter: Drafter | None, adaptive: bool, kernels: Mapping[str, Any]) -> None:
        self._adaptive = adaptive
        self._switched_off = MappingProxyType(dict(kernels))
        super().__init__(model, tokenizer, config, drafter)
