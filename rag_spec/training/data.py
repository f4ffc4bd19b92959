"""What every trained draft (the exit adapter, the draft head) learns from and how it is kept:
the texts (corpus passages and the model's own answers), the model's predictions on them read
through rag-spec's private runner, a read-out over the tokens the model predicts most, the
cross-entropy to the model's distribution inside it, and the cache of trained drafts."""

from __future__ import annotations

import hashlib
import os
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from rag_spec.errors import RagSpecError
from rag_spec.progress import progress as progress_bar

if TYPE_CHECKING:
    from rag_spec.corpus import Passage
    from rag_spec.training.own_answers import Answer

_TOP = 32  # teacher probabilities kept per position (the rest of its mass is negligible)
_LENGTH = 256  # tokens of a text trained on (the last ones of an answer)
Trained = TypeVar("Trained")


def training_sequences(lm: Any, sources: Sequence[str], texts: int, answers: int, *,
                       written: int = 0, progress: bool = True
                       ) -> tuple[Callable[[], list[list[int]]], str]:
    """What a draft trains on: ``texts`` passages of ``sources``, ``answers`` of the model's
    own answers (``own_answers``) and ``written`` more, longer ones to questions it wrote
    itself, shuffled, as a function that makes them (answering takes minutes: only called
    when no draft is cached, and answers kept from an earlier run are reused:
    ``remembered_answers``), and a fingerprint of the passages."""
    from rag_spec.corpus import fingerprint, load_passages

    passages = load_passages(sources)

    def make() -> list[list[int]]:
        chosen = random.Random(0).sample(passages, min(texts, len(passages)))
        sequences = lm.tokenizer([f"{p.title}\n{p.text}" for p in chosen], truncation=True,
                                 max_length=_LENGTH, add_special_tokens=False)["input_ids"]
        answered = training_answers(lm, passages, answers, written, progress=progress)
        sequences += [(prompt + answer)[-_LENGTH:] for prompt, answer in answered]
        random.Random(0).shuffle(sequences)  # the held-out tenth has both kinds
        return sequences

    return make, fingerprint(passages)


def training_answers(lm: Any, passages: Sequence[Passage], answers: int, written: int = 0, *,
                     progress: bool = True) -> list[Answer]:
    """The model's own answers a draft trains on, as (prompt, answer) token ids: ``answers``
    of them (``own_answers``' mix), then ``written`` more, longer ones to questions it wrote
    itself, from rag-spec's cache where an earlier run answered them."""
    from rag_spec.training.own_answers import remembered_answers

    answered = remembered_answers(lm.model, lm.tokenizer, passages, answers, progress=progress)
    if written:  # other questions than the first answers' (another seed)
        answered += remembered_answers(lm.model, lm.tokenizer, passages, written,
                                       written_share=1.0, max_new_tokens=128, seed=1000,
                                       progress=progress)
    return answered


@dataclass(frozen=True)
class DraftRecipe:
    """What a trained draft is and how a user trains it: named in every message about it."""

    what: str  # "draft head", "exit adapter after 8 layers"
    command: str  # the command that trains it, e.g. "rag-spec draft train --head"
    duration: str  # how long that takes on two CPU cores, e.g. "about an hour"


def train_command(lm: Any, sources: Sequence[str], flags: str) -> str:
    """The ``rag-spec draft train`` command that trains a draft for ``lm`` on ``sources``."""
    from rag_spec.models.registry import DEFAULT_MODEL

    words = ["rag-spec draft train", flags]
    words += [] if lm.name == DEFAULT_MODEL else [f"--model {lm.name}"]
    words += [] if list(sources) == ["stdlib"] else [f"--source {s}" for s in sources]
    return " ".join(words)


def cached_draft(lm: Any, kind: str, key: str, load: Callable[[Path], Trained],
                 train: Callable[[Path], Trained] | None,
                 save: Callable[[Trained, Path], None], recipe: DraftRecipe) -> Trained:
    """A trained draft (``kind``: what it is) for ``lm`` from rag-spec's cache, under a hash of
    ``key`` (what it was trained from). ``train`` is given a path beside it where it may keep
    its progress (``train_head``'s checkpoints).

    ``train`` None is serving, which never trains: a missing draft is a RagSpecError naming
    ``recipe.command`` and its duration. A damaged one is set aside (``*.damaged``, kept for a
    look) and said so; then trained again, or refused the same way."""
    from rag_spec.paths import atomic_file, cache_dir

    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    path = cache_dir() / "drafts" / f"{Path(lm.name).name}-{kind}-{digest}.safetensors"
    damaged = ""
    if path.is_file():
        try:
            return load(path)
        except Exception as err:  # any unreadable file: what loading raises depends on how
            aside = path.with_name(path.name + ".damaged")
            os.replace(path, aside)
            damaged = (f"The cached {recipe.what} for {lm.name} could not be read "
                       f"({type(err).__name__}) and was set aside as {aside}. ")
    if train is None:
        msg = (f"{damaged or f'No {recipe.what} is trained for {lm.name}. '}Answers never wait "
               f"for training: train it once with `{recipe.command}` ({recipe.duration} on two "
               f"CPU cores, cached after), then ask again; or leave out the draft for the "
               f"default (the shipped draft head + the trie where the model has one, else the "
               f"trie).")
        raise RagSpecError(msg)
    if damaged:
        print(f"rag-spec: {damaged}Training it again.", file=sys.stderr)
    trained = train(path.with_name(path.name + ".partial"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as scratch:
        save(trained, scratch)
    return trained


@dataclass
class TrainingSample:
    """One text: its tokens, the model's hidden states after some layer (the last: the states
    its LM head reads), and its top tokens and log-probs at each position."""

    ids: torch.Tensor  # [T]
    hidden: torch.Tensor  # [T, hidden]
    top_ids: torch.Tensor  # [T, _TOP]
    top_logprobs: torch.Tensor  # [T, _TOP]


@torch.no_grad()
def teacher_samples(model: Any, sequences: list[list[int]], layer: int, progress: bool
                    ) -> list[TrainingSample]:
    """The model's states after ``layer`` layers (-1: after its final norm) and predictions on
    each sequence, read through rag-spec's private copy of it (asking transformers for hidden
    states installs hooks on the modules it runs: those must not be the user's)."""
    from rag_spec.target.transformers.runner import Runner

    runner = Runner.of(model)
    samples = []
    for ids in progress_bar(sequences, "reading the full model's predictions", "text",
                            enabled=progress):
        tokens = torch.tensor(ids)
        out = runner(input_ids=tokens[None].to(runner.device), output_hidden_states=True)
        top = out.logits[0].float().log_softmax(-1).topk(_TOP)
        # copies made outside inference mode: training may save them for backward
        samples.append(TrainingSample(tokens, out.hidden_states[layer][0].float().cpu().clone(),
                                      top.indices.cpu().clone(), top.values.cpu().clone()))
    return samples


@dataclass
class TrainingSet:
    """A draft's training data: the held-out tenth (agreement is measured on it), the rest,
    and the tokens its read-out scores."""

    held_out: list[TrainingSample]
    train: list[TrainingSample]
    subset: torch.Tensor

    def shuffled(self, epochs: int) -> list[TrainingSample]:
        """The training samples ``epochs`` times, each epoch in its own seeded order."""
        return [s for epoch in range(epochs)
                for s in random.Random(epoch).sample(self.train, len(self.train))]


def training_set(model: Any, sequences: Sequence[Sequence[int]], layer: int, vocabulary: int,
                 what: str, progress: bool) -> TrainingSet:
    """The model's predictions on ``sequences`` (texts of a few words or more) after ``layer``
    layers (``teacher_samples``), split, with the ``vocabulary`` tokens it predicts most;
    ``what`` names the draft in the error a too small corpus gets."""
    sequences = [list(ids) for ids in sequences if len(ids) > 8]
    if len(sequences) < 10:
        msg = f"Training {what} needs at least 10 texts of a few words; give a larger corpus."
        raise RagSpecError(msg)
    samples = teacher_samples(model, sequences, layer, progress)
    subset = frequent_tokens(samples, model.get_output_embeddings().weight.shape[0], vocabulary)
    held = max(1, len(samples) // 10)
    return TrainingSet(samples[:held], samples[held:], subset)


def frequent_tokens(samples: list[TrainingSample], vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` tokens the model predicts most often (top-4), ascending."""
    counts = torch.zeros(vocab_size)
    for s in samples:
        counts += torch.bincount(s.top_ids[:, :4].reshape(-1), minlength=vocab_size)
    counts[counts == 0] = -1  # never-seen tokens last, in id order
    return counts.topk(min(size, vocab_size)).indices.sort().values


def subset_positions(subset: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] each token's index in ``subset`` (-1 outside it)."""
    position = torch.full((vocab_size,), -1, dtype=torch.long, device=subset.device)
    position[subset] = torch.arange(len(subset), device=subset.device)
    return position


def subset_cross_entropy(logq: torch.Tensor, top_ids: torch.Tensor, top_logprobs: torch.Tensor,
                         position: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of draft log-probs ``logq`` [T, subset] to the model's top tokens
    and log-probs [T, _TOP] (``position``: ``subset_positions``); mass outside the subset,
    which the draft cannot offer, counts for nothing."""
    where = position[top_ids.to(position.device)]
    teacher = top_logprobs.to(position.device).exp() * (where >= 0)
    return -(teacher * logq.gather(1, where.clamp(min=0))).sum(-1).mean()
