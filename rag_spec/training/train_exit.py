"""Training an exit adapter (``rag_spec.drafters.exit_adapter``): one decoder layer after the
target's first layers, matched to the full model's next-token distribution; cached per (model,
exit layer, corpus, sizes)."""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rag_spec.drafters.exit_adapter import ExitAdapter
from rag_spec.errors import RagSpecError
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

_VERSION = 3  # bump when training changes: cached adapters are trained again


def cached_exit(lm: Any, layers: int, sources: Sequence[str] = ("stdlib",), *,
                texts: int = 800, answers: int = 240, progress: bool = True,
                train: bool = True) -> ExitAdapter:
    """The adapter for ``lm`` exiting after ``layers`` layers, loaded from rag-spec's cache;
    trained the first time (minutes on a CPU) on ``texts`` passages of ``sources`` and
    ``answers`` of the model's own answers (``own_answers``) where ``train`` says so, else a
    RagSpecError naming ``rag-spec draft train``."""
    sequences, passages = training_sequences(lm, sources, texts, answers, progress=progress)
    key = f"{lm.name}|{layers}|{passages}|{texts}|{answers}|{_VERSION}"
    recipe = DraftRecipe(f"exit adapter after {layers} layers",
                         train_command(lm, sources, f"--layers {layers}"), "about 9 minutes")
    return cached_draft(lm, f"exit{layers}", key, ExitAdapter.load,
                        (lambda _: train_exit(lm.model, layers, sequences(), progress=progress))
                        if train else None, ExitAdapter.save, recipe)


def train_exit(model: Any, layers: int, sequences: Sequence[Sequence[int]], *,
               vocabulary: int = 8192, epochs: int = 3, lr: float = 1e-3,
               progress: bool = True) -> ExitAdapter:
    """Train an exit after ``layers`` layers of ``model`` to match its next-token distribution
    on token ``sequences`` (a tenth held out to measure agreement). The model is only read."""
    depth = len(model.get_decoder().layers)
    if not 1 <= layers < depth:
        msg = f"An exit needs 1 <= layers < {depth} (got {layers})."
        raise RagSpecError(msg)
    data = training_set(model, sequences, layers, vocabulary, "an exit", progress)
    trainer = _Trainer(model, layers, data.subset, lr)
    before = _agreement(samples=data.held_out, predict=lambda h: _untrained(model, h))
    for sample in progress_bar(data.shuffled(epochs), "training the exit", "text",
                               enabled=progress):
        trainer.step(sample)
    after = _agreement(samples=data.held_out, predict=trainer.predict)
    state = {k: v.detach().cpu().clone() for k, v in trainer.layer.state_dict().items()}
    return ExitAdapter(layers, state, data.subset, {"untrained": round(before, 4),
                                                    "trained": round(after, 4)})


class _Trainer:
    """The adapter layer (started from the target's layer ``layers``) and its optimiser, on the
    model's device; samples stay on the CPU and come over one at a time."""

    def __init__(self, model: Any, layers: int, subset: torch.Tensor, lr: float) -> None:
        decoder = model.get_decoder()
        self.device = model.device
        self.layer = copy.deepcopy(decoder.layers[layers]).float().train()
        frozen = _key_value_parameters(self.layer)
        for name, p in self.layer.named_parameters():
            p.requires_grad_(name not in frozen)
        self.norm = copy.deepcopy(decoder.norm).float().requires_grad_(False)  # the user's
        # norm must not collect gradients: training reads the model, never writes it
        self.rotary = decoder.rotary_emb
        self.subset = subset.to(self.device)
        self.head = model.get_output_embeddings().weight.detach()[self.subset].float()
        self.position = subset_positions(self.subset, model.get_output_embeddings().weight.shape[0])
        self.optimiser = torch.optim.AdamW([p for p in self.layer.parameters()
                                            if p.requires_grad], lr=lr)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, subset] draft logits after each position of one text."""
        length, hidden = hidden.shape[0], hidden.to(self.device)
        positions = torch.arange(length, device=self.device)[None]
        mask = torch.full((length, length), float("-inf"), device=self.device).triu(1)[None, None]
        out = self.layer(hidden[None], attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(hidden[None], positions))
        out = out[0] if isinstance(out, tuple) else out
        return self.norm(out)[0].float() @ self.head.T

    def step(self, sample: TrainingSample) -> None:
        logq = self.logits(sample.hidden).log_softmax(-1)
        loss = subset_cross_entropy(logq, sample.top_ids, sample.top_logprobs, self.position)
        self.optimiser.zero_grad()
        loss.backward()
        self.optimiser.step()

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.subset[self.logits(hidden).argmax(-1)].cpu()


def _key_value_parameters(layer: torch.nn.Module) -> set[str]:
    """The names of the parameters that make a decoder layer's keys and values (its input norm,
    key and value projections, a key norm): kept as the target's, so the target's entries for
    that layer are the adapter's and the exit drafts on the target's own cache."""
    makers = {"input_layernorm", "k_proj", "v_proj", "k_norm"}
    frozen = {name for name, _ in layer.named_parameters() if makers & set(name.split("."))}
    parts = {part for name in frozen for part in name.split(".")}
    if not {"k_proj", "v_proj"} <= parts:
        msg = (f"{type(layer).__name__} has no separate k_proj and v_proj: an exit adapter "
               "reads the target's cache through them. Use DraftModelDrafter instead.")
        raise RagSpecError(msg)
    return frozen


@torch.inference_mode()
def _untrained(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The plain early exit's greedy tokens: the final norm and full head on the exit's state."""
    decoder = model.get_decoder()
    hidden = hidden.to(model.device, model.dtype)
    return model.get_output_embeddings()(decoder.norm(hidden)).argmax(-1).cpu()


def _agreement(samples: list[TrainingSample], predict: Callable[[torch.Tensor], torch.Tensor]
               ) -> float:
    """How often the draft's greedy token is the full model's."""
    agree = total = 0
    for s in samples:
        agree += int((predict(s.hidden) == s.top_ids[:, 0]).sum())
        total += len(s.top_ids)
    return agree / max(total, 1)
