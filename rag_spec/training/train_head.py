"""Training the draft head (``rag_spec.drafters.draft_head``) on the model's own predictions,
one token ahead, and caching it per (model, corpus, sizes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rag_spec.drafters.draft_head import DraftHead, load_head, publish_head, save_head
from rag_spec.progress import progress as progress_bar
from rag_spec.training.data import (
    DraftRecipe,
    TrainingSample,
    cached_draft,
    subset_cross_entropy,
    subset_positions,
    train_command,
    training_sequences,
    training_set,
)

_VERSION = 2  # bump when training changes: cached heads are trained again
# passes over the texts, at a rate decaying linearly to zero: on the embedded model the head so
# agreed with its next token 55% of the time held out, after 6 at a constant rate 51%
_EPOCHS = 10


def cached_head(lm: Any, sources: Sequence[str] = ("stdlib",), *, texts: int = 800,
                answers: int = 240, written: int = 800, epochs: int = _EPOCHS,
                progress: bool = True, train: bool = True) -> DraftHead:
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
    head = cached_draft(lm, "head", key, lambda path: load_head(lm.model, path),
                        (lambda: train_head(lm.model, sequences(), epochs=epochs,
                                            progress=progress)) if train else None,
                        save_head, recipe)
    if train:  # every decoder on this model drafts with it by default from now on
        publish_head(lm.model, head)
    return head


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
