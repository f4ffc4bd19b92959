"""Drafting from the target's own hidden states with a trained draft head (``draft_head``).

Each verification pass keeps the target's last hidden state before every row's new root (the
state its LM head read to choose that token: ``TreeKVCache.root_features``). A round feeds the
head that state and the root, which gives the draft distribution of the next token and the
head's guess of the state after the root; each deeper pass feeds a node's parent's guessed state
and the node's token. Trees grow as a draft model's do (``model_drafter``: dynamic expansion,
depth by measured acceptance, ``draft_probs`` for sampling); no KV cache is read or written.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from rag_spec.drafters.draft_head import DraftHead, find_head
from rag_spec.drafters.drafter import Capabilities, DraftRequest, TargetView
from rag_spec.drafters.model_drafter import (
    DraftBatch,
    DraftPasses,
    ModelDrafter,
    SharedPasses,
    _weights,
)
from rag_spec.errors import RagSpecError
from rag_spec.policy.expansion import Expansion
from rag_spec.target.transformers.runner import Runner
from rag_spec_kernels import linear_stacks


class _HeadPasses(SharedPasses):
    """The head's passes over the target's states, and its guessed states of this round's
    nodes."""

    def __init__(self, head: DraftHead, target: TargetView) -> None:
        runner = target.runner
        super().__init__(runner, cost=_weights(head) / _weights(runner.module))
        self.head = head  # on the runner's kernels (``FeatureDrafter.head_for``)
        # the head scores the tokens the model predicts most: its logits are those columns
        # (kept on the CPU, where drafting maps them to tokens, once per batch)
        self.columns, self.vocab_size = head.subset.cpu(), head.lm_head.vocab_size
        self.table = runner.module.get_input_embeddings().weight  # the target's, read only
        self.states: torch.Tensor | None = None  # [B, round, hidden]

    def shape(self, batch: DraftBatch, requests: Sequence[DraftRequest], expansion: Expansion
              ) -> Expansion | None:
        """No draft before a verification pass kept the states (the first step after the
        prefill)."""
        return expansion if batch.cache.root_features is not None else None

    def forward(self, batch: DraftBatch, rows: int,
                feeds: dict[int, list[tuple[int, int, list[int]]]]) -> tuple[torch.Tensor, int]:
        """The head on each fed token and the state before it: the root's is the target's, a
        node's its parent's guessed state (the last slot it sees)."""
        roots = batch.cache.root_features
        assert roots is not None
        first = 0 if self.states is None else self.states.shape[1]
        width = max(len(f) for f in feeds.values())
        # gathered in one indexing each (a pass follows the target's step, which has pushed
        # torch's own code and data out of cache: every small operator costs more then): each
        # fed state is a row of the roots' states, then every row's guessed ones
        tokens, picks = [0] * (rows * width), [0] * (rows * width)  # padding: unread outputs
        for b, fed in feeds.items():
            for j, (token, _, slots) in enumerate(fed):
                tokens[b * width + j] = token
                picks[b * width + j] = rows + b * first + slots[-1] if slots else b
        held = roots if self.states is None else torch.cat([roots, self.states.flatten(0, 1)])
        before = held[torch.tensor(picks, device=roots.device)].view(rows, width, -1)
        embedded = self.table[torch.tensor(tokens, device=roots.device).view(rows, width)]
        states = self.head.advance(before.to(self.table.dtype), embedded)
        logits = self.head.lm_head.readout(states)  # the subset's columns (``columns``)
        self.states = states if self.states is None else torch.cat([self.states, states], 1)
        return logits, first

    def end_round(self, batch: DraftBatch) -> None:
        self.states = None


class FeatureDrafter(ModelDrafter):
    """Token trees from a draft head on the target's hidden states (EAGLE-style self-draft):
    a few percent of a step per pass, no second model, no KV cache of its own.

    Args:
        head: a trained ``DraftHead`` for this model; ``FeatureDrafter.trained(model)`` finds
            the one shipped with rag-spec or trained by ``rag-spec draft train --head``.
        expansion: the trees' shape; by default the eight likeliest next tokens, each only
            if the head gives it at least 2%, and up to three passes more, each only below a
            path at least 20% likely by the head's probabilities (and while the measured
            acceptance pays for the pass): elsewhere deeper nodes are seldom reached
            (docs/concepts.md, "Why the defaults").
            ``Expansion(top=8, min_prob=0.02, max_depth=1)`` drafts one deep.

    Examples:
        >>> drafter = FeatureDrafter.trained(lm.model)                       # doctest: +SKIP
        >>> LookaheadDecoder(lm.model, lm.tokenizer, drafter=drafter)           # doctest: +SKIP
    """

    label = "draft head"

    # the decoder keeps the target's states before each root; its hits come about
    # independently step to step (budget.STEADY_SMOOTHING)
    capabilities = Capabilities(reads_features=True, steady=True)

    def __init__(self, head: DraftHead, *, expansion: Expansion | None = None) -> None:
        super().__init__(expansion or Expansion(top=8, min_prob=0.02, max_depth=4, grow_prob=0.2))
        self.head = head
        self._fast: weakref.WeakKeyDictionary[Runner, DraftHead] = weakref.WeakKeyDictionary()

    @classmethod
    def trained(cls, model: Any, *, expansion: Expansion | None = None) -> FeatureDrafter:
        """Drafts from the head trained for ``model``: the user's (``rag-spec draft train
        --head``), else the one shipped with rag-spec (the embedded model's)."""
        head = find_head(model)
        if head is None:
            msg = ("no draft head is trained for this model: run `rag-spec draft train --head "
                   "--model FOLDER` once, or draft with the trie (TrieDrafter())")
            raise RagSpecError(msg)
        return cls(head, expansion=expansion)

    def draft_passes(self, target: TargetView, requests: Sequence[DraftRequest]
                     ) -> DraftPasses:
        """The head's passes, on the target's kernels and states."""
        return _HeadPasses(self.head_for(target.runner), target)

    def head_for(self, runner: Runner) -> DraftHead:
        """The head multiplying through the kernels ``runner`` multiplies through (a private
        copy, built once per runner; called under the drafter's lock), from 8-bit weights
        where the streamed kernel runs: a pass follows the target's step, which has pushed
        the head out of cache, so it costs what it reads, and a draft need not equal float32
        products (docs/concepts.md, "Why the defaults")."""
        fast = self._fast.get(runner)
        if fast is None:
            with torch.inference_mode(False):  # drafting runs in it; weights track versions
                fast = self._fast[runner] = copy.deepcopy(self.head)
            if runner.stacks:
                own = {id(module) for module in fast.modules()}
                for parent, name, stack, index in linear_stacks(
                        fast, own, runner.settings.streamed_linear, torch.int8):
                    parent._modules[name] = stack.modules()[index]
        return fast
