"""A trained exit for early-exit drafting, in the spirit of Kangaroo and EAGLE: one decoder layer
on the target's first ``layers`` layers, trained to match the full model's next-token
distribution on the user's own corpus and on the model's own answers (``own_answers``), then the
target's final norm and an LM head over the tokens the model predicts most there. The layer's
keys and values stay the target's (its input norm, key and value projections are not trained):
the exit drafts on the target's own KV cache, whose entries for that layer are then exactly the
adapter's.

An untrained exit (the first layers, then the final norm and LM head) agrees with the full model
rarely, because those layers were never trained to be read out. The adapter layer learns that
read-out; the smaller head (the most frequent ``vocabulary`` tokens, by default 8192 of the
embedded model's 49152) cuts the head's cost, a fifth of the embedded model's weights, to a
sixth of that. Tokens outside it get probability 0 in the draft: they are never drafted, and
verification is exact whatever the draft offers.

``rag_spec.training.train_exit`` trains it, once per (model, exit layer, corpus, sizes), cached
like the indexes; ``rag-spec draft train`` shows progress and reports top-1 agreement with the
full model before and after.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rag_spec.drafters.draft_head import SubsetHead


@dataclass
class ExitAdapter:
    """A trained exit after the target's first ``layers`` layers."""

    layers: int
    layer_state: dict[str, torch.Tensor]  # the adapter decoder layer's weights
    subset: torch.Tensor  # [n] token ids the draft head scores, ascending
    agreement: dict[str, float]  # top-1 agreement with the full model on held-out text

    def attach(self, view: Any) -> Any:
        """``view`` (``first_layers(target, layers)``) with the adapter layer after its layers
        and the subset head; the view's modules and config are its own, so only it changes."""
        decoder = view.get_decoder()
        config = decoder.config
        with torch.random.fork_rng(devices=[]):  # its random start is overwritten: the
            # caller's torch RNG must not move for it
            layer = type(decoder.layers[0])(config, layer_idx=self.layers)
        layer.load_state_dict(self.layer_state)
        layer.to(device=view.device, dtype=view.dtype).eval()
        decoder._modules["layers"] = torch.nn.ModuleList([*decoder.layers, layer])
        config.num_hidden_layers = self.layers + 1
        if getattr(config, "layer_types", None):
            config.layer_types = [*config.layer_types, config.layer_types[-1]]
        head = view.get_output_embeddings()
        rows = head.weight.detach()[self.subset.to(head.weight.device)].clone()
        for name, child in view._modules.items():
            if child is head:
                view._modules[name] = SubsetHead(rows, self.subset.to(rows.device),
                                                 head.weight.shape[0])
        return view

    def save(self, path: Path) -> None:
        from safetensors.torch import save_file

        tensors = {f"layer.{k}": v.contiguous() for k, v in self.layer_state.items()}
        tensors["subset"] = self.subset
        save_file(tensors, str(path), metadata={"layers": str(self.layers),
                                                 "agreement": json.dumps(self.agreement)})

    @classmethod
    def load(cls, path: Path) -> ExitAdapter:
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as file:
            meta = file.metadata()
            tensors = {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
        state = {k.removeprefix("layer."): v for k, v in tensors.items() if k != "subset"}
        return cls(int(meta["layers"]), state, tensors["subset"], json.loads(meta["agreement"]))
