"""kNN-LM (Khandelwal et al. 2020), served naively or with speculative retrieval (RaLMSpec).

At every step the model's key is searched in the datastore; the ``k`` nearest entries vote for
the tokens that followed them, weighted by softmax(-distance / temperature), and
``p = lambda * p_kNN + (1 - lambda) * p_LM``.

A datastore search per token dominates the cost. KNNSpeculation (``KNNSpeculation``) guesses each
step's neighbours from a small cache of entries near the last verified ones, decodes on, and
checks a stride of steps with one batched search. The check is relaxed: a step stands when the
token chosen from the true neighbours equals the guessed step's token (the neighbours may
differ); at the first that does not, decoding rolls back to it. The model's keys and logits
depend only on the tokens before, so the output is the naive loop's, token for token, greedy
or sampled (a sampled step draws from its own seeded uniform, the same in both loops).
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rag_spec.errors import RagSpecError
from rag_spec.knnlm.datastore import KNNDatastore, model_fingerprint
from rag_spec.knnlm.keys import KeyedLM
from rag_spec.knnlm.neighbour_cache import NeighbourCache
from rag_spec.retrieval.os3 import StrideScheduler
from rag_spec.speculation import Cancel, Speculation, SpeculationTally, speculate
from rag_spec.target.transformers.kv_cache import new_cache
from rag_spec.threads import run_in_compute_thread


@dataclass(frozen=True)
class KNNSpeculation:
    """How speculative kNN-LM guesses and verifies.

    Args:
        successors: entries cached after each verified neighbour (the datastore is in corpus
            order: they are the continuations of the text the neighbour came from).
        capacity: most entries the cache holds (the oldest leave first).
        os3: pick each stride with OS3 from measured step and search latencies and the hit
            rate (else ``stride``).
        stride: steps guessed per verification when ``os3`` is off.
        max_stride: OS3's longest stride.
    """

    successors: int = 8
    capacity: int = 4096
    os3: bool = True
    stride: int = 4
    max_stride: int = 32


@dataclass
class KNNStats(SpeculationTally):
    """Where a request's time went and what the datastore was asked (and, speculating, what
    the loop guessed: ``SpeculationTally``; a hit is a guessed step whose token the
    verification confirmed)."""

    kb_calls: int = 0
    queries_verified: int = 0
    retrieval_seconds: float = 0.0  # inside datastore searches
    generation_seconds: float = 0.0  # model forward passes
    guess_seconds: float = 0.0  # searching the cache


@dataclass
class KNNResult:
    text: str
    token_ids: list[int]
    stats: KNNStats


Neighbours = tuple[np.ndarray, np.ndarray]  # (distances, datastore ids) of one step


@dataclass
class _Step:
    """A step about to be decoded: the model's view before it, and its guessed neighbours."""

    position: int  # in the output
    logits: torch.Tensor
    key: np.ndarray
    guess: Neighbours | None  # None: the cache had nothing to guess from
    token: int | None = None  # chosen from the guess, once decoded on it


class KNNLM:
    """A language model interpolated with nearest neighbours from a datastore.

    Args:
        lm: a loaded model (``rag_spec.load_model``), the one the datastore was built with.
        datastore: its ``KNNDatastore``.
        k: neighbours per step.
        lambda_: weight of the neighbours' distribution.
        temperature: softmax temperature over negative squared distances.
        speculation: speculative retrieval settings; None runs the naive loop (a search per
            token). The output is the same either way.

    Examples:
        >>> lm = rag_spec.load_model()                                   # doctest: +SKIP
        >>> store = rag_spec.KNNDatastore.open(lm)                        # doctest: +SKIP
        >>> rag_spec.KNNLM(lm, store).generate("os.path.join\\n").text   # doctest: +SKIP
    """

    def __init__(self, lm: Any, datastore: KNNDatastore, *, k: int = 16, lambda_: float = 0.25,
                 temperature: float = 10.0,
                 speculation: KNNSpeculation | None = KNNSpeculation()) -> None:  # noqa: B008
        if datastore.model != model_fingerprint(lm.model):
            msg = ("This datastore holds another model's hidden states (or other weights'); "
                   "build one for this model: KNNDatastore.open(lm, rebuild=True).")
            raise RagSpecError(msg)
        if k < 1 or not 0 <= lambda_ <= 1 or temperature <= 0:
            msg = f"Need k >= 1, 0 <= lambda_ <= 1 and temperature > 0 (got {k}, {lambda_}, " \
                  f"{temperature})."
            raise RagSpecError(msg)
        self.lm = lm
        self.datastore = datastore
        self.k = k
        self.lambda_ = lambda_
        self.temperature = temperature
        self.speculation = speculation
        self.keyed = KeyedLM.of(lm.model, datastore.key)
        self._learned: StrideScheduler | None = None  # the latest request's measurements
        self._lock = threading.Lock()  # one request at a time: each teaches the scheduler

    def distribution(self, logits: torch.Tensor, distances: np.ndarray,
                     ids: np.ndarray) -> torch.Tensor:
        """p = lambda * p_kNN + (1 - lambda) * p_LM over the vocabulary (float64)."""
        p = torch.softmax(logits.double(), -1) * (1 - self.lambda_)
        weights = torch.softmax(torch.from_numpy(-distances.astype(np.float64)) /
                                self.temperature, -1)
        values = torch.from_numpy(self.datastore.values[ids])
        return p.index_add_(0, values, weights * self.lambda_)

    def generate(self, prompt: str, max_new_tokens: int = 64, *, do_sample: bool = False,
                 seed: int = 0) -> KNNResult:
        """Continue ``prompt``; the same tokens whether or not retrieval is speculative."""
        if max_new_tokens < 1:
            msg = f"max_new_tokens must be at least 1 (got {max_new_tokens})."
            raise RagSpecError(msg)
        prompt_ids = self.lm.tokenizer(prompt)["input_ids"]
        if not prompt_ids:
            msg = "The prompt is empty; a kNN-LM needs a context to continue."
            raise RagSpecError(msg)
        with self._lock, torch.inference_mode():
            run = _Run(self, prompt_ids, max_new_tokens, do_sample, seed)
            if self.speculation is None:
                run.naive()
            else:
                spec = self.speculation
                speculate(_Guesses(run, NeighbourCache(self.datastore, spec.capacity,
                                                       spec.successors)),
                          self._scheduler(spec), run.stats)
        text = self.lm.tokenizer.decode(run.output, skip_special_tokens=True)
        return KNNResult(text, run.output, run.stats)

    async def agenerate(self, prompt: str, max_new_tokens: int = 64, *,
                        do_sample: bool = False, seed: int = 0) -> KNNResult:
        """``generate`` on rag-spec's compute thread: the event loop stays free."""
        return await run_in_compute_thread(functools.partial(
            self.generate, prompt, max_new_tokens, do_sample=do_sample, seed=seed))

    def _scheduler(self, spec: KNNSpeculation) -> StrideScheduler:
        """A stride scheduler that starts from the previous request's measurements."""
        scheduler = StrideScheduler(os3=spec.os3, fixed=spec.stride, max_stride=spec.max_stride)
        if self._learned is not None:
            scheduler.resume(self._learned)
        self._learned = scheduler
        return scheduler


class _Run:
    """One request: the output so far and the model's KV cache over prompt + output. The
    newest token is fed lazily (``feed``), so decoding on a guess that turns out wrong never
    pays a forward pass it does not need."""

    def __init__(self, knn: KNNLM, prompt_ids: list[int], limit: int, do_sample: bool,
                 seed: int) -> None:
        self.knn = knn
        self.limit = limit
        self.do_sample = do_sample
        self.seed = seed
        self.prompt_length = len(prompt_ids)
        eos = knn.lm.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.output: list[int] = []
        self.done = False
        self.stats = KNNStats()
        self.cache = new_cache()
        self.device = next(knn.lm.model.parameters()).device
        self._fed = 0  # output tokens in the cache
        self.logits, self.key = self._forward(prompt_ids)

    def naive(self) -> None:
        """A datastore search per token."""
        while not self.done:
            self.feed()
            distances, ids = self.search(self.key[None])
            self.emit(self.choose(len(self.output), self.logits, distances[0], ids[0]))

    def feed(self) -> None:
        """Run the model on the newest token, if not yet: ``logits`` and ``key`` are then the
        next step's."""
        if self._fed < len(self.output):
            self.logits, self.key = self._forward(self.output[self._fed:])
            self._fed = len(self.output)

    def choose(self, position: int, logits: torch.Tensor, distances: np.ndarray,
               ids: np.ndarray) -> int:
        """The token at output ``position``: greedy, or drawn with that position's own uniform
        (the same in every loop, whatever was guessed before)."""
        p = self.knn.distribution(logits, distances, ids)
        if not self.do_sample:
            return int(torch.argmax(p))
        u = np.random.default_rng([self.seed, position]).random()
        cumulative = torch.cumsum(p, 0)
        return int(min(torch.searchsorted(cumulative, u * cumulative[-1], right=True),
                        len(p) - 1))

    def emit(self, token: int) -> None:
        """Append ``token``; generation is over at an end token or the limit."""
        self.output.append(token)
        self.done = token in self.eos or len(self.output) >= self.limit

    def rollback(self, position: int, token: int) -> None:
        """Replace the output from ``position`` on with ``token``."""
        del self.output[position:]
        surplus = self.cache.get_seq_length() - (self.prompt_length + position)
        if surplus > 0:
            self.cache.crop(-surplus)  # transformers 5: a negative count removes that many
        self._fed = min(self._fed, position)
        self.emit(token)

    def search(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        started = time.perf_counter()
        found = self.knn.datastore.search(keys, self.knn.k)
        self.stats.retrieval_seconds += time.perf_counter() - started
        self.stats.kb_calls += 1
        self.stats.queries_verified += len(keys)
        return found

    def _forward(self, ids: list[int]) -> tuple[torch.Tensor, np.ndarray]:
        started = time.perf_counter()
        logits, keys = self.knn.keyed(torch.tensor([ids], device=self.device), self.cache)
        self.stats.generation_seconds += time.perf_counter() - started
        return logits[0, -1].cpu(), keys[0, -1].cpu().numpy()


class _Guesses(Speculation[_Step, Neighbours]):
    """kNN-LM on the speculation loop: a point is a step, its guess the neighbours the cache
    of entries near verified ones ranks first. A step stands when the token its true
    neighbours choose is the guessed step's (the neighbours may differ)."""

    def __init__(self, run: _Run, cache: NeighbourCache) -> None:
        self.run = run
        self.cache = cache

    def advance(self, cancel: Cancel) -> tuple[_Step | None, bool]:
        run = self.run  # a step is one token: nothing to cut short (not cancellable)
        if run.done:
            return None, True
        run.feed()
        guess = None
        if len(self.cache):  # else nothing to guess from yet: the datastore is asked outright
            started = time.perf_counter()
            guess = self.cache.search(run.key, run.knn.k)
            self.cache.add(guess[1])  # the guessed texts read on: so does the cache
            run.stats.guess_seconds += time.perf_counter() - started
        return _Step(len(run.output), run.logits, run.key, guess), False

    def guessed(self, point: _Step) -> bool:
        return point.guess is not None

    def go_on(self, point: _Step, truth: Neighbours | None) -> None:
        if truth is None:
            assert point.guess is not None
            point.token = self.run.choose(point.position, point.logits, *point.guess)
            self.run.emit(point.token)
        else:
            self.run.emit(self.run.choose(point.position, point.logits, *truth))

    def verify(self, points: Sequence[_Step], foreground: bool
               ) -> tuple[list[Neighbours], float]:
        started = time.perf_counter()
        distances, ids = self.run.search(np.stack([p.key for p in points]))
        seconds = time.perf_counter() - started
        self.cache.add(ids)
        return list(zip(distances, ids)), seconds

    def right(self, point: _Step, truth: Neighbours) -> bool:
        token = point.token
        if token is None:  # the round's last step: verified before decoding on it
            assert point.guess is not None
            token = self.run.choose(point.position, point.logits, *point.guess)
        return self.run.choose(point.position, point.logits, *truth) == token

    def roll_back(self, point: _Step, truth: Neighbours) -> None:
        self.run.rollback(point.position,
                          self.run.choose(point.position, point.logits, *truth))
