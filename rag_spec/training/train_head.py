"""Training the draft head (``rag_spec.drafters.draft_head``) on the model's own predictions,
one token ahead, and caching it per (model, corpus, sizes)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Sequence
from pathlib import Path
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

_VERSION = 3  # bump when training changes: cached heads are trained again
# passes over the texts, at a rate decaying linearly to zero: on the embedded model the head so
# agreed with its next token more often held out than after fewer passes at a constant rate
_EPOCHS = 10
# Trained through its own guessed states (HASS's and EAGLE-3's "training-time test"): a deeper
# draft feeds the head the state it guessed, never the model's, so the head learns from what it
# will be fed. Each depth's loss weighs this much (the first, which every pass drafts, most).
_DEPTH_WEIGHTS = (1.0, 0.5, 0.25)


def cached_head(lm: Any, sources: Sequence[str] = ("stdlib",), *, texts: int = 800,
                answers: int = 240, written: int = 1200, epochs: int = _EPOCHS,
                progress: bool = True, train: bool = True) -> DraftHead:
    """The draft head for ``lm``, trained the first time (about an hour and a half on two CPU
    cores, half of it the model answering) on ``texts`` passages of ``sources``, ``answers`` of
    the model's own answers and ``written`` more to questions it wrote itself, loaded from
    rag-spec's cache after; with ``train`` False a missing head is a RagSpecError naming
    ``rag-spec draft train --head``.

    A head is cheap to run but knows only what it read: the written answers are what teaches
    it open-ended answers, and more of them kept helping (docs/concepts.md, "The draft
    head")."""
    sequences, fingerprint = training_sequences(lm, sources, texts, answers, written=written,
                                                progress=progress)
    key = f"{lm.name}|head|{fingerprint}|{texts}|{answers}|{written}|{epochs}|{_VERSION}"
    recipe = DraftRecipe("draft head", train_command(lm, sources, "--head"),
                         "about an hour and a half")
    head = cached_draft(lm, "head", key, lambda path: load_head(lm.model, path),
                        (lambda partial: train_head(lm.model, sequences(), epochs=epochs,
                                                    progress=progress, checkpoint=partial))
                        if train else None,
                        save_head, recipe)
    if train:  # every decoder on this model drafts with it by default from now on
        publish_head(lm.model, head)
    return head


def train_head(model: Any, sequences: Sequence[Sequence[int]], *, vocabulary: int = 8192,
               epochs: int = _EPOCHS, lr: float = 5e-4, progress: bool = True,
               checkpoint: Path | None = None) -> DraftHead:
    """Train a draft head to predict ``model``'s next-token distribution one to three tokens
    ahead of its hidden state (deeper ones from its own guessed states), on token
    ``sequences`` (a tenth held out to measure agreement). The model is only read (its
    predictions come from rag-spec's private copy).

    With ``checkpoint``, the training's state is kept there after each epoch, and a run that
    stopped goes on from its last one: the head is the one a run that never stopped trains
    (training is ~40 minutes of the embedded model's head). Removed once trained."""
    data = training_set(model, sequences, -1, vocabulary, "a draft head", progress)
    head = DraftHead(model, data.subset).float().train()
    table = model.get_input_embeddings().weight.detach().float()
    position = subset_positions(head.subset, head.lm_head.vocab_size)
    before = _agreement(head, table, data.held_out)
    optimiser = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr)
    samples = data.shuffled(epochs)
    schedule = torch.optim.lr_scheduler.LinearLR(optimiser, 1.0, 0.0, total_iters=len(samples))
    state = _TrainingState(checkpoint, head, optimiser, schedule, len(samples))
    done = state.resumed()
    for at in progress_bar(range(done, len(samples)), "training the draft head"
                           + (f" (from text {done}: a stopped run's)" if done else ""), "text",
                           enabled=progress):
        loss = _loss(head, table, position, samples[at])
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        schedule.step()
        if (at + 1) % len(data.train) == 0 and at + 1 < len(samples):  # an epoch's end
            state.keep(at + 1)
    state.finished()
    head.agreement = {"untrained": _agreement_of(before),
                      "trained": _agreement_of(_agreement(head, table, data.held_out))}
    return head.to(model.dtype).eval().requires_grad_(False)


class _TrainingState:
    """A head's training as it stands (weights, optimiser, schedule, texts done) in a file, so
    a stopped run goes on where it was. What cannot be read, or is another training's, is
    trained afresh."""

    def __init__(self, path: Path | None, head: DraftHead, optimiser: torch.optim.Optimizer,
                 schedule: Any, total: int) -> None:
        self.path, self.head, self.optimiser, self.schedule = path, head, optimiser, schedule
        self.total = total

    def resumed(self) -> int:
        """Texts done by the run that left the state (loaded into the training), or 0."""
        if self.path is None or not self.path.is_file():
            return 0
        fresh = (copy.deepcopy(self.head.state_dict()), copy.deepcopy(self.optimiser.state_dict()),
                 self.schedule.state_dict())
        try:
            kept = torch.load(self.path, map_location="cpu", weights_only=True)
            if kept["total"] != self.total:
                return 0
            self.head.load_state_dict(kept["head"])
            self.optimiser.load_state_dict(kept["optimiser"])
            self.schedule.load_state_dict(kept["schedule"])
            return int(kept["done"])
        except Exception as err:  # unreadable, or another training's: trained afresh
            print(f"rag-spec: the draft head's training state in {self.path} could not be "
                  f"taken up ({type(err).__name__}); training from the start.", file=sys.stderr)
            self.head.load_state_dict(fresh[0])
            self.optimiser.load_state_dict(fresh[1])
            self.schedule.load_state_dict(fresh[2])
            return 0

    def keep(self, done: int) -> None:
        if self.path is None:
            return
        from rag_spec.paths import atomic_file

        with atomic_file(self.path) as scratch:
            torch.save({"done": done, "total": self.total, "head": self.head.state_dict(),
                        "optimiser": self.optimiser.state_dict(),
                        "schedule": self.schedule.state_dict()}, scratch)

    def finished(self) -> None:
        if self.path is not None:
            self.path.unlink(missing_ok=True)


def _unrolled(head: DraftHead, table: torch.Tensor, sample: TrainingSample, depth: int
              ) -> list[torch.Tensor]:
    """The head's guessed states ``1..depth`` tokens past each position, as it drafts them: the
    first from the model's state at t and token t + 1, each deeper one from the head's own
    guess and the next token; ``[k - 1]`` holds the states after tokens k .. T - 1."""
    hidden, ids = sample.hidden.to(table.device), sample.ids.to(table.device)
    states, state = [], hidden[:-1]
    for k in range(1, min(depth, len(ids) - 1) + 1):
        state = head.advance(state if k == 1 else state[:-1], table[ids[k:]])
        states.append(state)
    return states


def _loss(head: DraftHead, table: torch.Tensor, position: torch.Tensor,
          sample: TrainingSample) -> torch.Tensor:
    """At each depth: cross-entropy to the model's distribution there (its top tokens inside
    the subset), plus EAGLE's regression of the guessed state onto the model's (what the next
    depth is fed)."""
    loss = torch.zeros((), device=table.device)
    for k, (weight, state) in enumerate(zip(_DEPTH_WEIGHTS, _unrolled(
            head, table, sample, len(_DEPTH_WEIGHTS))), 1):
        logq = head.lm_head.readout(state).log_softmax(-1)
        cross_entropy = subset_cross_entropy(logq, sample.top_ids[k:], sample.top_logprobs[k:],
                                             position)
        target = sample.hidden[k:].to(table.device)
        loss = loss + weight * (cross_entropy
                                + 0.1 * torch.nn.functional.smooth_l1_loss(state, target))
    return loss


@torch.no_grad()
def _agreement(head: DraftHead, table: torch.Tensor, samples: list[TrainingSample]
               ) -> list[list[int]]:
    """Per depth (the head's first guess, then each fed its own guessed state): (top-1 hits,
    top-4 hits, positions), how often the model's greedy token there is the head's greedy
    token, or among its four likeliest."""
    counts = [[0, 0, 0] for _ in _DEPTH_WEIGHTS]
    for sample in samples:
        for k, state in enumerate(_unrolled(head, table, sample, len(_DEPTH_WEIGHTS)), 1):
            guesses = head.subset[head.lm_head.readout(state).topk(4).indices].cpu()
            truth = sample.top_ids[k:, 0]
            tally = counts[k - 1]
            tally[0] += int((guesses[:, 0] == truth).sum())
            tally[1] += int((guesses == truth[:, None]).any(-1).sum())
            tally[2] += len(truth)
    return counts


def _agreement_of(counts: list[list[int]]) -> dict[str, float]:
    """The first guess's agreement (``top1``, ``top4``), and each deeper one's
    (``top1_depth2`` ...)."""
    rates: dict[str, float] = {}
    for depth, (top1, top4, total) in enumerate(counts, 1):
        suffix = "" if depth == 1 else f"_depth{depth}"
        rates[f"top1{suffix}"] = round(top1 / max(total, 1), 4)
        rates[f"top4{suffix}"] = round(top4 / max(total, 1), 4)
    return rates
