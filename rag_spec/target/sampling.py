"""The target model's token choice at every tree node: argmax, or one sample of the processed
distribution. Repetition penalty, temperature, top-k and top-p are applied as transformers
applies them, with each node's own context (the committed tokens plus the node's ancestors).

A sample is drawn by inverse CDF from one uniform number per *output position*, shared by all
nodes at the same depth. Only one node per depth lies on the accepted path and its uniform is
fresh there, so the output has plain sampling's distribution; and a seed fixes the output
whatever the drafts were, which is what makes sampled speculation testable token for token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rag_spec.errors import RagSpecError
from rag_spec.target.tree import TokenTree


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is picked; the defaults are greedy decoding."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    repetition_penalty: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        check_sampling(self.temperature, self.top_k, self.top_p, self.repetition_penalty,
                       greedy_at_zero=False)


def check_sampling(temperature: float, top_k: int, top_p: float, repetition_penalty: float, *,
                   greedy_at_zero: bool) -> None:
    """Refuse sampling settings that no decoding honours, in one sentence: the decoder's and
    every framework class's settings go through here. ``greedy_at_zero``: the caller's
    ``temperature=0`` means greedy decoding (the frameworks' convention; the decoder's is
    ``do_sample=False``)."""
    problems = []
    if greedy_at_zero and temperature < 0:
        problems.append(f"temperature must be >= 0 (0 decodes greedily; got {temperature})")
    elif not greedy_at_zero and temperature <= 0:
        problems.append(f"temperature must be > 0 (use do_sample=False for greedy; got "
                        f"{temperature})")
    if top_k < 0:
        problems.append(f"top_k must be >= 0 (0 turns it off; got {top_k})")
    if not 0 < top_p <= 1:
        problems.append(f"top_p must be in (0, 1] (got {top_p})")
    if repetition_penalty <= 0:
        problems.append(f"repetition_penalty must be > 0 (1.0 turns it off; got "
                        f"{repetition_penalty})")
    if problems:
        msg = "Invalid sampling settings: " + "; ".join(problems) + "."
        raise RagSpecError(msg)


class RowSampler:
    """One row's token choices: argmax for greedy decoding (which draws no random numbers), or
    samples driven by the row's own generators (torch's global RNG is never touched).

    Uniform numbers are indexed by output position and drawn in fixed blocks, so a seed fixes
    the output whatever the drafts were (for drafts without probabilities). Drafters that sample
    draw from ``draft_generator``, and multi-step speculative sampling from ``fresh``, two other
    streams of the same seed.
    """

    _BLOCK = 256

    def __init__(self, params: SamplingParams, seed: int | None = None) -> None:
        if params.do_sample and seed is None:
            msg = "sampling needs a seed for its row's generator"
            raise ValueError(msg)
        self.params = params
        self._generator = _generator(seed, 0) if params.do_sample else None
        self.draft_generator = _generator(seed, 1) if params.do_sample else None
        self._fresh = _generator(seed, 2) if params.do_sample else None
        self._uniforms = torch.empty(0)

    def choices(self, logits: torch.Tensor, context: Sequence[int], tree: TokenTree,
                position: int) -> list[int]:
        """The target's token after the root and after each node.

        Args:
            logits: [1 + n, vocab] logits for the root then the n tree nodes.
            context: committed token ids (prompt and output so far, the root token last).
            tree: the draft the logits were computed for.
            position: output position of the token after the root (tokens generated so far).
        """
        uniforms = None
        if self._generator is not None:
            needed = position + 1 + (int(tree.depths.max()) if len(tree) else 0)
            while len(self._uniforms) < needed:
                block = torch.rand(self._BLOCK, generator=self._generator)
                self._uniforms = torch.cat([self._uniforms, block])
            uniforms = self._uniforms[position:needed]
        return target_choices(logits, context, tree, self.params, uniforms)

    def fresh(self) -> float:
        """A uniform number in [0, 1) that no other decision used (sampling only)."""
        if self._fresh is None:
            msg = "greedy decoding draws no random numbers"
            raise ValueError(msg)
        return float(torch.rand((), generator=self._fresh, dtype=torch.float64))


def _generator(seed: int | None, stream: int) -> torch.Generator:
    """Stream ``stream`` of a row's seed: independent generators for independent decisions."""
    return torch.Generator().manual_seed((int(seed or 0) + stream * 0x9E3779B97F4A7C15) % 2**63)


def processed_logits(logits: torch.Tensor, seen: Sequence[Sequence[int]],
                     params: SamplingParams) -> torch.Tensor:
    """[rows, vocab] logits as the sampler sees them: repetition penalty (``seen[i]``: the
    tokens before row i's next token), then, when sampling, temperature, top-k and top-p.
    Drafters process their own logits with this too, so p and q are alike."""
    logits = logits.float()
    if params.repetition_penalty != 1.0 and any(len(s) for s in seen):
        mask = torch.zeros_like(logits, dtype=torch.bool)
        rows = torch.cat([torch.full((len(s),), i, dtype=torch.long) for i, s in enumerate(seen)])
        columns = torch.cat([torch.as_tensor(list(s), dtype=torch.long) for s in seen])
        mask[rows, columns] = True
        logits = _penalise(logits, mask, params.repetition_penalty)
    if not params.do_sample:
        return logits
    logits = logits / params.temperature
    if params.top_k:
        logits = _top_k(logits, params.top_k)
    if params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    return logits


def target_probs(logits: torch.Tensor, context: Sequence[int], tree: TokenTree,
                 params: SamplingParams) -> Sequence[torch.Tensor]:
    """The target's sampling distribution ([vocab]) after the root (index 0) and after each
    node (index 1 + node), each computed when first read."""
    return _PerNode(logits, context, tree, params,
                    lambda row, processed: torch.softmax(processed, dim=-1))


def target_choices(logits: torch.Tensor, context: Sequence[int], tree: TokenTree,
                   params: SamplingParams, uniforms: torch.Tensor | None = None
                   ) -> Sequence[int]:
    """The target's token after the root (index 0) and after each node (index 1 + node), each
    computed when first read.

    Args:
        logits: [1 + n, vocab] logits for the root then the n tree nodes.
        context: committed token ids (prompt and output so far, the root token last).
        tree: the draft the logits were computed for.
        uniforms: [>= 1 + depth] uniform numbers in [0, 1) for the next output positions
            (sampling only).
    """
    if not params.do_sample:
        return _PerNode(logits, context, tree, params,
                        lambda row, processed: int(processed.argmax()))
    if uniforms is None:
        msg = "sampling needs one uniform number per output position"
        raise ValueError(msg)
    depths = [0, *tree.depths.tolist()]

    def sample(row: int, processed: torch.Tensor) -> int:
        cdf = torch.softmax(processed, dim=-1).cumsum(dim=-1)
        cdf = cdf / cdf[-1]  # exactly 1.0 at the end, so u < 1 always lands on a token
        u = uniforms[depths[row]].to(cdf.device, cdf.dtype).reshape(1)
        # The first token whose cumulative probability exceeds u; zero-probability tokens never do.
        return int(torch.searchsorted(cdf, u, right=True))

    return _PerNode(logits, context, tree, params, sample)


class _PerNode(Sequence):
    """``finish(row, processed logits)`` for the root (row 0) and each node (row 1 + node),
    computed when first read. Verification reads one path of the tree, and processing a row
    costs a sort of the vocabulary under top-p: every row of a 12-node tree took longer than the
    step's forward pass saves on the embedded model."""

    def __init__(self, logits: torch.Tensor, context: Sequence[int], tree: TokenTree,
                 params: SamplingParams, finish: Callable[[int, torch.Tensor], Any]) -> None:
        self.logits, self.context, self.tree, self.params = logits, context, tree, params
        self.finish = finish
        self.rows: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.logits)

    def __getitem__(self, row: int) -> Any:  # type: ignore[override]
        if row not in self.rows:
            self.rows[row] = self.finish(row, self._processed(row))
        return self.rows[row]

    def _processed(self, row: int) -> torch.Tensor:
        """``processed_logits`` for one row, seeing the context and the node's ancestors."""
        seen: list[list[int]] = []
        if self.params.repetition_penalty != 1.0:
            ancestors = self.tree.ancestor_mask[row - 1].nonzero()[0] if row else ()
            seen = [[*self.context, *(self.tree.tokens[a] for a in ancestors)]]
        return processed_logits(self.logits[row:row + 1], seen, self.params)[0]


def _penalise(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """Penalise the ``seen`` tokens (CTRL's rule, as transformers applies it)."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


# tokens ``_top_p`` looks for the nucleus among before it sorts a whole vocabulary
_TOP_P_CANDIDATES = 1024


def _top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    k = min(k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches ``top_p``: a token
    stays while the tokens likelier than it hold less than ``top_p`` (transformers' rule).

    Sorting a whole vocabulary costs a noticeable share of a small model's step on a CPU;
    the nucleus is almost always among the ``_TOP_P_CANDIDATES`` likeliest tokens, which
    ``topk`` finds in a tenth of the time, so only rows whose candidates hold less than
    ``top_p`` are sorted whole.
    """
    candidates = min(_TOP_P_CANDIDATES, logits.shape[-1])
    values, order = logits.topk(candidates, dim=-1)  # descending
    probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
    if bool((probs.sum(dim=-1) < top_p).any()):
        values, order = logits.sort(dim=-1, descending=True)
        probs = values.softmax(dim=-1)
    above = probs.cumsum(dim=-1) - probs  # probability of the tokens likelier than each
    remove = torch.ones_like(logits, dtype=torch.bool).scatter(-1, order, above >= top_p)
    return logits.masked_fill(remove, float("-inf"))
