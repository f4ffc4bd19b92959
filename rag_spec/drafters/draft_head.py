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

``rag_spec.training.train_head`` trains it; ``rag-spec draft train --head`` shows progress and
reports agreement before and after.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import skip_init

from rag_spec.errors import RagSpecError


class SubsetHead(torch.nn.Module):
    """An LM head over some tokens: full-vocabulary logits, -inf outside ``subset``."""

    def __init__(self, weight: torch.Tensor, subset: torch.Tensor, vocab_size: int) -> None:
        super().__init__()
        # [len(subset), hidden], a plain linear layer: the runner's kernels can take it; made
        # without a random start (torch's global RNG is the caller's)
        self.readout = skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0], bias=False,
                                 device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.readout.weight.copy_(weight)
        self.readout.requires_grad_(False)
        self.register_buffer("subset", subset.clone())
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        small = self.readout(hidden)
        logits = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., self.subset] = small
        return logits


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
        subset: full-vocabulary logits made its steps much slower)."""
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


def save_head(head: DraftHead, path: Path) -> None:
    """What ``load_head`` reads: the trained weights, the subset and the agreement."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in head.trained_state().items()}, str(path),
              metadata={"agreement": json.dumps(head.agreement)})
