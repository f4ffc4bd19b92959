"""The lossless speculative decode loop: draft a token tree, verify it in one forward pass,
keep the longest path the model agrees with plus one bonus token, compact the KV cache.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from rag_spec.decoding.acceptance import accept
from rag_spec.decoding.budget import AdaptiveBudget
from rag_spec.decoding.drafter import Drafter, DraftSession
from rag_spec.decoding.kv_cache import crop, fill, fill_only, keep_accepted, tree_batch
from rag_spec.decoding.sampling import SamplingParams, target_choices
from rag_spec.decoding.stopping import StopRule
from rag_spec.decoding.streaming import TextStream
from rag_spec.decoding.tree import TokenTree
from rag_spec.decoding.trie_drafter import TrieDrafter, TrieMode
from rag_spec.errors import RagSpecError
from rag_spec_kernels import use_onednn_linear, use_tree_attention


@dataclass(frozen=True)
class LookaheadConfig:
    """Drafting knobs; the defaults suit RAG answers on a CPU."""

    budget: int = 12  # most draft nodes verified per step
    branch_length: int = 8  # longest drafted continuation
    mode: TrieMode = "tree"  # "tree" (hierarchical) or "chains" (parallel branches)
    adaptive: bool = True  # shrink the budget while drafts keep missing
    memory_mb: float = 64.0  # bound on the trie's memory of earlier outputs
    onednn_linear: bool = True  # CPU: oneDNN matrix products (a weight copy; cheap tree steps)


@dataclass
class DecodeStats:
    """Where a generation's steps and time went."""

    steps: int = 0
    drafted: int = 0  # draft nodes verified, all steps
    accepted_per_step: list[int] = field(default_factory=list)  # draft tokens kept (no bonus)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0
    forward_seconds: float = 0.0
    bookkeeping_seconds: float = 0.0

    @property
    def tokens_per_step(self) -> float:
        """Tokens committed per forward pass (accepted drafts plus the bonus)."""
        return (sum(self.accepted_per_step) + self.steps) / max(self.steps, 1)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "tokens_per_step": round(self.tokens_per_step, 3)}


@dataclass
class GenerationResult:
    """New tokens only (prompt excluded), their text, and how they were produced."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "stop" or "length"
    stats: DecodeStats


@dataclass
class _Row:
    """One request in flight."""

    prompt: list[int]
    session: DraftSession
    budget: AdaptiveBudget
    uniforms: torch.Tensor | None = None  # [max_new + budget + 1] one per output position
    remember: bool = True  # hand the finished output to the drafter's cross-request memory
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.output


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
                yield from self._flush()
        finally:
            self.close()

    def close(self) -> None:
        """Stop generating (the decoder is free again)."""
        self._steps.close()

    def _flush(self) -> Iterator[str]:
        pieces, self._pieces[:] = list(self._pieces), []
        yield from pieces


def _drain(steps: Generator[None, None, list[GenerationResult]]) -> list[GenerationResult]:
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


class LookaheadDecoder:
    """Speculative decoding for any transformers causal LM, with plain decoding's exact output.

    Examples:
        >>> dec = LookaheadDecoder(lm.model, lm.tokenizer)               # doctest: +SKIP
        >>> dec.generate(ids, max_new_tokens=64).token_ids                # doctest: +SKIP
    """

    def __init__(self, model: Any, tokenizer: Any = None, config: LookaheadConfig | None = None,
                 drafter: Drafter | None = None) -> None:
        _check_model(model)
        self.model = model
        self.tokenizer = tokenizer
        self.config = config or LookaheadConfig()
        self.drafter: Drafter = drafter or TrieDrafter(
            branch_length=self.config.branch_length, mode=self.config.mode,
            memory_mb=self.config.memory_mb)
        self._context: list[list[int]] = []
        self._lock = threading.Lock()  # one generation at a time (streams hold it between steps)

    def add_context(self, texts: Sequence[str]) -> None:
        """Documents the next ``generate`` call may copy from (e.g. retrieved passages)."""
        self._require_tokenizer("add_context")
        self._context.extend(self.tokenizer(list(texts), add_special_tokens=False)["input_ids"])

    def generate(self, input_ids: Any, max_new_tokens: int = 128, *, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                 repetition_penalty: float = 1.0, stop: Sequence[str] = (),
                 streamer: Callable[[str], None] | Any = None,
                 attention_mask: Any = None, seed: int | None = None,
                 context: Sequence[str] = (),
                 ) -> GenerationResult | list[GenerationResult]:
        """Generate up to ``max_new_tokens`` after each prompt.

        Args:
            input_ids: one prompt (list of ids, 1-D tensor, or [1, T] tensor) or a batch (list of
                lists, or [B, T] tensor with ``attention_mask`` for padding).
            stop: strings that end generation; the text is cut before them.
            streamer: receives each settled piece of text (a callable), or token ids (a
                transformers streamer); single prompts only.
            seed: fixes sampled output, whatever the drafts (default: drawn from torch's RNG).
            context: documents this call may copy from, like ``add_context`` but for this call
                only (safe when threads share the decoder).

        Returns:
            A GenerationResult for a single prompt, a list of them for a batch.
        """
        prompts, single = _prompts(input_ids, attention_mask)
        if streamer is not None and len(prompts) > 1:
            msg = "A streamer follows one prompt; call generate once per prompt to stream each."
            raise RagSpecError(msg)
        steps = self._steps(prompts, max_new_tokens, SamplingParams(
            do_sample, temperature, top_k, top_p, repetition_penalty), stop, seed, context,
            streamer)
        results = _drain(steps)
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
            options.pop("context", ()), pieces.append, hand_back=True, **options), pieces)

    def _steps(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams,
               stop: Sequence[str], seed: int | None, context: Sequence[str],
               streamer: Callable[[str], None] | Any = None, hand_back: bool = False,
               ) -> Generator[None, None, list[GenerationResult]]:
        """The whole generation as a generator: one ``yield`` per decoding step, holding the
        decoder meanwhile; returns the results. ``hand_back``: the caller runs its own code
        between steps (a stream), so the fast path is entered per step and never leaks."""
        if max_new_tokens <= 0:
            msg = f"max_new_tokens must be at least 1 (got {max_new_tokens})."
            raise RagSpecError(msg)
        if stop:
            self._require_tokenizer("stop strings")
        if context:
            self._require_tokenizer("context documents")
        documents = self.tokenizer(list(context), add_special_tokens=False)["input_ids"] \
            if context else []
        self._check_length(prompts)
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())  # torch.manual_seed still governs
        generator = torch.Generator().manual_seed(seed)
        with self._lock:
            documents, self._context = self._context + documents, []
            rows = [_Row(p, self.drafter.session(p, documents), AdaptiveBudget(
                self.config.budget, adaptive=self.config.adaptive),
                uniforms=torch.rand(max_new_tokens + self.config.budget + 1,
                                    generator=generator) if params.do_sample else None)
                for p in prompts]
            rules = [StopRule(self.tokenizer, self._eos_ids(), stop,
                              self._max_new(p, max_new_tokens)) for p in prompts]
            stream = TextStream(streamer, rules[0], prompts[0]) if streamer is not None else None
            yield from self._decode(rows, rules, params, stream, per_step=hand_back)
        return [GenerationResult(r.output, rule.final_text(r.output) if self.tokenizer else "",
                                 r.finish_reason or "length", r.stats)
                for r, rule in zip(rows, rules)]

    def extend(self, cache: Any, context: list[int], max_new_tokens: int, session: DraftSession,
               budget: AdaptiveBudget) -> GenerationResult:
        """Greedy tokens after ``context`` for a caller that manages its own KV cache.

        Iterative RaLM keeps one cache per passage and decodes a few tokens at a time; this
        lets it verify drafts too. ``cache`` (a DynamicCache, one row) holds every position
        before the last token of the sequence; ``context`` ends with that token and is what
        ``session`` drafts from. On return the cache holds the sequence up to, not including,
        the last new token, so consecutive calls chain. The session and budget persist across
        calls; nothing is remembered across requests (call ``session.finish`` at the end).
        """
        rule = StopRule(self.tokenizer, self._eos_ids(), (), max_new_tokens)
        row = _Row(list(context), session, budget, remember=False)
        length = cache.get_seq_length()
        valid = torch.ones(1, length, dtype=torch.bool, device=self.model.device)
        roots, positions = [context[-1]], [length]
        with self._lock, self._computing():
            while row.finish_reason is None:
                valid = self._step([row], [rule], SamplingParams(), cache, roots, positions,
                                   valid)
        crop(cache, length + len(row.output))  # a cut-short last step may have kept more
        return GenerationResult(row.output, "", row.finish_reason or "length", row.stats)

    def fill(self, cache: Any, tokens: list[int]) -> None:
        """Append ``tokens`` to a one-row cache the caller manages (``extend``'s prefill), on
        the same fast path as the steps that follow."""
        with self._lock, self._computing():
            fill(self.model, cache, tokens)

    @contextlib.contextmanager
    def _computing(self) -> Iterator[None]:
        """The model's fast verification path (entering it patches ~200 layers: ~2 ms)."""
        with torch.inference_mode(), use_tree_attention(self.model), \
                use_onednn_linear(self.model, self.config.onednn_linear):
            yield

    def _decode(self, rows: list[_Row], rules: list[StopRule], params: SamplingParams,
                stream: TextStream | None, per_step: bool) -> Iterator[None]:
        whole, each = ((contextlib.nullcontext(), self._computing) if per_step
                       else (self._computing(), contextlib.nullcontext))
        with whole:
            started = time.perf_counter()
            with each():
                cache, valid = self._prefill([r.prompt[:-1] for r in rows])
            for r in rows:
                r.stats.prefill_seconds = time.perf_counter() - started
            roots = [r.prompt[-1] for r in rows]
            positions = [len(r.prompt) - 1 for r in rows]
            while any(r.finish_reason is None for r in rows):
                with each():
                    valid = self._step(rows, rules, params, cache, roots, positions, valid)
                if stream is not None:
                    stream.update(rows[0].output, rows[0].finish_reason is not None)
                yield

    def _step(self, rows: list[_Row], rules: list[StopRule], params: SamplingParams, cache: Any,
              roots: list[int], positions: list[int], valid: torch.Tensor) -> torch.Tensor:
        """One step for every row: draft, verify in one forward pass, accept, compact the cache.
        Advances ``roots`` and ``positions`` in place; returns the new validity mask."""
        # 1. Draft: a tree per unfinished row (finished rows ride along with no draft).
        t0 = time.perf_counter()
        active = [r.finish_reason is None for r in rows]
        trees = [r.session.propose(r.context, r.budget.current) if on else TokenTree.empty()
                 for r, on in zip(rows, active)]
        # 2. Verify: one forward pass over every row's root and tree.
        t1 = time.perf_counter()
        step = tree_batch(roots, trees, positions, valid, self.model.dtype)
        logits = self.model(input_ids=step.input_ids, position_ids=step.position_ids,
                            attention_mask=step.attention_mask, past_key_values=cache,
                            use_cache=True).logits
        t2 = time.perf_counter()
        # 3. Accept: the longest path matching the target's choices, plus a bonus token.
        keep = []
        for b, (row, tree) in enumerate(zip(rows, trees)):
            uniforms = None if row.uniforms is None else row.uniforms[len(row.output):]
            choices = target_choices(logits[b, :1 + len(tree)], row.context, tree, params,
                                     uniforms)
            path, bonus = accept(tree, choices)
            keep.append([0] + [1 + node for node in path])
            if active[b]:
                self._commit(row, rules[b], tree.path_tokens(path) + [bonus], len(tree))
            roots[b] = bonus
            positions[b] += 1 + len(path)
        # 4. Roll back: keep only the accepted slots of the KV cache.
        valid = keep_accepted(cache, valid.shape[1], keep, valid)
        t3 = time.perf_counter()
        for row, on in zip(rows, active):
            if on:
                row.stats.draft_seconds += t1 - t0
                row.stats.forward_seconds += t2 - t1
                row.stats.bookkeeping_seconds += t3 - t2
        return valid

    def _commit(self, row: _Row, rule: StopRule, tokens: list[int], drafted: int) -> None:
        """Append tokens one by one until a stop rule fires; teach the drafter what was kept."""
        before = len(row.context)
        for token in tokens:
            row.output.append(token)
            row.finish_reason = rule.finish_reason(row.output)
            if row.finish_reason is not None:
                break
        row.stats.steps += 1
        row.stats.drafted += drafted
        row.stats.accepted_per_step.append(len(tokens) - 1)
        row.budget.update(drafted, len(tokens) - 1)
        row.session.observe(row.context, before)
        if row.finish_reason is not None and row.remember:
            row.session.finish(row.output)

    def _prefill(self, prefixes: list[list[int]]) -> tuple[Any, torch.Tensor]:
        """Run the prompts except their last token, left-padded; return the cache and validity."""
        from transformers import DynamicCache

        device = self.model.device
        cache = DynamicCache(config=self.model.config)
        width = max(len(p) for p in prefixes)
        valid = torch.zeros(len(prefixes), width, dtype=torch.bool, device=device)
        if width == 0:
            return cache, valid
        ids = torch.zeros(len(prefixes), width, dtype=torch.long)
        for b, p in enumerate(prefixes):
            if p:
                ids[b, width - len(p):] = torch.tensor(p)
                valid[b, width - len(p):] = True
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        mask = None  # no padding: the model's own causal path
        if not valid.all():
            causal = torch.tril(torch.ones(width, width, dtype=torch.bool, device=device))
            allowed = (causal[None] & valid[:, None, :]) | torch.eye(width, dtype=torch.bool,
                                                                      device=device)
            mask = torch.zeros(allowed.shape, dtype=self.model.dtype, device=device)
            mask.masked_fill_(~allowed, torch.finfo(self.model.dtype).min)
            mask = mask[:, None]
        self.model(input_ids=ids.to(device), position_ids=positions, attention_mask=mask,
                   past_key_values=cache, use_cache=True, **fill_only(self.model))
        return cache, valid

    def _eos_ids(self) -> list[int]:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        if eos is None:
            return []
        return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]

    def _context_window(self) -> int | None:
        return getattr(self.model.config, "max_position_embeddings", None)

    def _max_new(self, prompt: list[int], max_new_tokens: int) -> int:
        window = self._context_window()
        return max_new_tokens if window is None else min(max_new_tokens, window - len(prompt))

    def _check_length(self, prompts: list[list[int]]) -> None:
        window = self._context_window()
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


def _check_model(model: Any) -> None:
    config = getattr(model, "config", None)
    if config is None or not callable(model):
        msg = "LookaheadDecoder needs a transformers causal LM (e.g. AutoModelForCausalLM)."
        raise RagSpecError(msg)
    if getattr(config, "is_encoder_decoder", False):
        msg = (f"{type(model).__name__} is an encoder-decoder model; rag-spec decodes "
               f"decoder-only causal LMs (Llama, Qwen2, Mistral, SmolLM2, ...).")
        raise RagSpecError(msg)
