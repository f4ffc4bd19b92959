"""A feature-level draft head (EAGLE's idea, Li et al. 2024, in its lightest form): from the
target's last hidden state before a token and that token's embedding, one small block predicts
the hidden state after the token, read out by the target's final norm and an LM head over the
tokens the model predicts most.

Why it drafts cheaply and well: the target's final hidden state already encodes the context
(the head needs no attention and no KV cache of its own), and the block costs a few percent of
a step (one MLP the size of one of the target's, and the smaller head). Measured on the embedded
model after minutes of CPU training on its own answers and the corpus: the target's next token
is the head's top-1 on 55% of held-out positions and in its top-4 on 74%; an untrained head
agrees on under 1%. Deeper drafts feed the head's own predicted state back in (less accurate:
the target's state is known only for committed tokens).

Trained once per (model, corpus, sizes) and cached like the exit adapters (``exit_adapter``);
``rag-spec draft train --head`` shows progress and reports agreement before and after.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import skip_init

from rag_spec.decoding.draft_training import (
    DraftRecipe,
    SubsetHead,
    TrainingSample,
    cached_draft,
    subset_cross_entropy,
    subset_positions,
    train_command,
    training_sequences,
    training_set,
)
from rag_spec.errors import RagSpecError
from rag_spec.progress import progress as progress_bar

_VERSION = 2  # bump when training changes: cached heads are trained again
# passes over the texts, at a rate decaying linearly to zero: on the embedded model the head so
# agreed with its next token 55% of the time held out, after 6 at a constant rate 51%
_EPOCHS = 10


class DraftHead(torch.nn.Module):
    """hidden state before a token + the token -> (hidden state after it, draft logits).

    ``fc`` mixes the two inputs; then one residual MLP block and the final norm, both started
    from the target's last layer and norm; the LM head's rows for ``subset`` (frozen, the
    target's own). Embeddings are looked up in the target's table (passed in, not copied)."""

    def __init__(self, model: Any, subset: torch.Tensor) -> None:
        super().__init__()
        decoder = model.get_decoder()
        last = decoder.layers[-1]
        if not (hasattr(last, "mlp") and hasattr(last, "post_attention_layernorm")):
            msg = (f"{type(last).__name__} has no mlp and post_attention_layernorm to start a "
                   "draft head from; use EarlyExitDrafter or DraftModelDrafter instead.")
            raise RagSpecError(msg)
        hidden = model.config.hidden_size
        # layers made without a random start (set below): torch's global RNG is the caller's
        self.fc = skip_init(torch.nn.Linear, 2 * hidden, hidden)
        with torch.no_grad():  # start as the mean of the two inputs
            self.fc.weight.copy_(torch.cat([torch.eye(hidden), torch.eye(hidden)], 1) / 2)
            self.fc.bias.zero_()
        self.norm = copy.deepcopy(last.post_attention_layernorm)
        self.mlp = copy.deepcopy(last.mlp)
        self.final_norm = copy.deepcopy(decoder.norm)
        head = model.get_output_embeddings().weight.detach()
        self.lm_head = SubsetHead(head[subset.to(head.device)], subset.to(head.device),
                               head.shape[0])
        self.agreement: dict[str, dict[str, float]] = {}  # held out, before and after training
        self.to(device=head.device, dtype=head.dtype)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden`` [..., H] the target's (or the head's) state before each token,
        ``embedded`` [..., H] the token's embedding -> (state after it, logits [..., vocab])."""
        state = self.advance(hidden, embedded)
        return state, self.lm_head(state)

    def advance(self, hidden: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """The guessed state after each token, without logits (training reads out only the
        subset: full-vocabulary logits made its steps 1.5x slower)."""
        x = self.fc(torch.cat([hidden, embedded], -1))
        return self.final_norm(x + self.mlp(self.norm(x)))

    @property
    def subset(self) -> torch.Tensor:
        """The token ids the head scores, ascending."""
        return self.lm_head.subset

    def trained_state(self) -> dict[str, torch.Tensor]:
        """The weights training changes, and the subset (the head's rows are the target's)."""
        state = {k: v for k, v in self.state_dict().items() if not k.startswith("lm_head.")}
        return {k: v.detach().cpu().clone() for k, v in {**state, "subset": self.subset}.items()}


def load_head(model: Any, path: Path) -> DraftHead:
    """A head saved by ``cached_head`` for ``model``."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        meta = file.metadata()
        tensors = {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
    head = DraftHead(model, tensors["subset"])
    head.load_state_dict({k: v for k, v in tensors.items() if k != "subset"}, strict=False)
    # (the LM head's rows are the model's)
    head.agreement = json.loads(meta["agreement"])
    return head.eval().requires_grad_(False)


def cached_head(lm: Any, sources: Sequence[str] = ("stdlib",), *, texts: int = 800,
                answers: int = 240, written: int = 800, epochs: int = _EPOCHS, progress: bool = True,
                train: bool = True) -> DraftHead:
    """The draft head for ``lm``, trained the first time (about 25 minutes on a CPU, more than
    half of it the model answering) on ``texts`` passages of ``sources``, ``answers`` of the
    model's own answers and ``written`` more to questions it wrote itself, loaded from
    rag-spec's cache after; with ``train`` False a missing head is a RagSpecError naming
    ``rag-spec draft train --head``.

    A head is cheap to run but knows only what it read: trained without the ``written``
    answers, it guessed the embedded model's next token in open-ended answers first 23% of the
    time (among its four likeliest, 44%); with 800 of them, 31% (52%)."""
    sequences, fingerprint = training_sequences(lm, sources, texts, answers, written=written,
                                                progress=progress)
    key = f"{lm.name}|head|{fingerprint}|{texts}|{answers}|{written}|{epochs}|{_VERSION}"
    recipe = DraftRecipe("draft head", train_command(lm, sources, "--head"),
                         "about 25 minutes")
    return cached_draft(lm, "head", key, lambda path: load_head(lm.model, path),
                        (lambda: train_head(lm.model, sequences(), epochs=epochs,
                                            progress=progress)) if train else None,
                        save_head, recipe)


def save_head(head: DraftHead, path: Path) -> None:
    """What ``load_head`` reads: the trained weights, the subset and the agreement."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in head.trained_state().items()}, str(path),
              metadata={"agreement": json.dumps(head.agreement)})


def train_head(model: Any, sequences: Sequence[Sequence[int]], *, vocabulary: int = 8192,
               epochs: int = _EPOCHS, lr: float = 5e-4, progress: bool = True) -> DraftHead:
    """Train a draft head to predict ``model``'s next-token distribution one token ahead of its
    hidden state, on token ``sequences`` (a tenth held out to measure agreement). The model is
    only read (its predictions come from rag-spec's private copy)."""
    data = training_set(model, sequences, -1, vocabulary, "a draft head", progress)
    head = DraftHead(model, data.subset).float().train()
    table = model.get_input_embeddings().weight.detach().float()
    position = subset_positions(head.subset, head.lm_head.vocab_size)
    before = _agreement(head, table, data.held_out)
    optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    samples = data.shuffled(epochs)
    schedule = torch.optim.lr_scheduler.LinearLR(optimiser, 1.0, 0.0, total_iters=len(samples))
    for sample in progress_bar(samples, "training the draft head", "text", enabled=progress):
        loss = _loss(head, table, position, sample)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
    head.agreement = {"untrained": _agreement_of(before),
                      "trained": _agreement_of(_agreement(head, table, data.held_out))}
    return head.to(model.dtype).eval().requires_grad_(False)


def _inputs(sample: TrainingSample, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's inputs at each position t < T - 1: the state at t and token t + 1."""
    hidden = sample.hidden.to(table.device)
    return hidden[:-1], table[sample.ids[1:].to(table.device)]


def _loss(head: DraftHead, table: torch.Tensor, position: torch.Tensor,
          sample: TrainingSample) -> torch.Tensor:
    """Cross-entropy to the model's distribution one token ahead (its top tokens inside the
    subset), plus EAGLE's regression of the predicted state onto the model's next state (what
    a deeper draft feeds back)."""
    state = head.advance(*_inputs(sample, table))
    logq = head.lm_head.readout(state).log_softmax(-1)
    cross_entropy = subset_cross_entropy(logq, sample.top_ids[1:], sample.top_logprobs[1:],
                                         position)
    target = sample.hidden[1:].to(table.device)
    return cross_entropy + 0.1 * torch.nn.functional.smooth_l1_loss(state, target)


@torch.no_grad()
def _agreement(head: DraftHead, table: torch.Tensor, samples: list[TrainingSample]
               ) -> tuple[int, int, int]:
    """(top-1 hits, top-4 hits, positions): how often the model's greedy next token is the
    head's greedy token, or among its four likeliest."""
    top1 = top4 = total = 0
    for sample in samples:
        state = head.advance(*_inputs(sample, table))
        guesses = head.subset[head.lm_head.readout(state).topk(4).indices].cpu()
        truth = sample.top_ids[1:, 0]
        top1 += int((guesses[:, 0] == truth).sum())
        top4 += int((guesses == truth[:, None]).any(-1).sum())
        total += len(truth)
    return top1, top4, total


def _agreement_of(counts: tuple[int, int, int]) -> dict[str, float]:
    top1, top4, total = counts
    return {"top1": round(top1 / max(total, 1), 4), "top4": round(top4 / max(total, 1), 4)}
