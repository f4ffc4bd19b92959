"""A feature-level draft head (EAGLE's idea, Li et al. 2024, in its lightest form): from the
target's last hidden state before a token and that token's embedding, one small block predicts
the hidden state after the token, read out by the target's final norm and an LM head over the
tokens the model predicts most.

Why it drafts cheaply and well: the target's final hidden state already encodes the context
(the head needs no attention and no KV cache of its own), and the block costs a few percent of
a step (one MLP the size of one of the target's, and the smaller head). Deeper drafts feed the
head its own guessed state (the target's is known only for committed tokens), so it is trained
on those too, three tokens deep (``train_head``). The shipped head's held-out agreement is in
its metadata (``agreement``); ``rag-spec draft train --head`` prints it.

``rag_spec.training.train_head`` trains it; ``rag-spec draft train --head`` shows progress and
reports agreement before and after. A trained head is found again by the model it was trained
for (``model_fingerprint``): in rag-spec's cache, where training publishes it, or among the heads
shipped in this package (``heads/``, the embedded model's: ``find_head``).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.nn.utils import skip_init

from rag_spec.errors import RagSpecError

log = logging.getLogger(__name__)

SHIPPED = Path(__file__).parent / "heads"  # heads that ship with rag-spec, by fingerprint
# the config fields that say what a model computes (not how it was loaded)
_SHAPE = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
          "num_attention_heads", "num_key_value_heads", "rope_theta", "tie_word_embeddings")


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

    def __init__(self, model: Any, subset: torch.Tensor, trained_for: str | None = None) -> None:
        """``trained_for``: ``model``'s fingerprint where the caller has it (it reads every
        weight)."""
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
        self.trained_for = trained_for or model_fingerprint(model)  # the model it drafts for
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


def model_fingerprint(model: Any) -> str:
    """What a head was trained for: the model's shape and the first values of every weight,
    rounded to bfloat16 first, so that the float32 and bfloat16 loads of one model agree (and a
    model fine-tuned since does not). The first values, not a spread: a model loaded from a
    file maps its weights' pages in only as something reads them, and a spread of samples
    would page every weight in."""
    return _fingerprint(model, lambda flat: flat[:64])


def _spread_fingerprint(model: Any) -> str:
    """The fingerprint heads published before ``model_fingerprint`` read each weight's first
    values were named by: 64 values spread over each weight (``find_head`` renames them)."""
    return _fingerprint(model, lambda flat: flat[::max(1, flat.numel() // 64)][:64])


def _fingerprint(model: Any, sample: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """The model's shape and ``sample`` of each flattened weight, in bfloat16, hashed."""
    digest = hashlib.blake2b(digest_size=12)
    config = model.config
    digest.update(json.dumps([getattr(config, key, None) for key in _SHAPE]).encode())
    with torch.no_grad():
        for name, weight in model.named_parameters():
            digest.update(name.encode())
            digest.update(sample(weight.detach().reshape(-1)).to(torch.bfloat16)
                          .view(torch.int16).cpu().numpy().tobytes())
    return digest.hexdigest()


def find_head(model: Any) -> DraftHead | None:
    """The trained head for ``model`` if one exists: the user's (``rag-spec draft train
    --head`` publishes it in rag-spec's cache), else one shipped with rag-spec; None where
    neither is (or neither could be read: the trie drafts alone then)."""
    fingerprint = model_fingerprint(model)
    user = _user_heads()
    if user is not None:
        _rename_published(model, user, fingerprint)
    for folder in (user, SHIPPED):
        path = None if folder is None else folder / f"{fingerprint}.safetensors"
        if path is None or not path.is_file():
            continue
        try:
            return load_head(model, path, fingerprint)
        except Exception as err:  # a damaged file must not stop answers: drafts are optional
            log.warning("rag-spec: the draft head %s could not be read (%s: %s); drafting "
                        "with the trie alone.", path, type(err).__name__, err)
    return None


def _rename_published(model: Any, folder: Path, fingerprint: str) -> None:
    """A head the user published for ``model`` under its older fingerprint
    (``_spread_fingerprint``), published again under ``fingerprint``; looked for only where
    the user has published heads, none under ``fingerprint``."""
    if (folder / f"{fingerprint}.safetensors").is_file() or not any(
            folder.glob("*.safetensors")):
        return
    older = folder / f"{_spread_fingerprint(model)}.safetensors"
    if not older.is_file():
        return
    try:
        head = load_head(model, older, older.stem)
    except Exception:  # noqa: BLE001 - damaged: left where it is, as any unreadable head
        return
    head.trained_for = fingerprint
    publish_head(model, head)
    older.unlink(missing_ok=True)


def publish_head(model: Any, head: DraftHead) -> Path | None:
    """Put ``head`` where ``find_head`` looks for ``model``'s (rag-spec's cache), so every
    decoder on the model drafts with it by default; returns the file (None: no cache here)."""
    folder = _user_heads()
    if folder is None:
        return None
    from rag_spec.paths import atomic_file

    path = folder / f"{model_fingerprint(model)}.safetensors"
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_file(path) as scratch:
        save_head(head, scratch)
    return path


def _user_heads() -> Path | None:
    """Where heads the user trained are published; None without rag-spec's cache (the
    decoder runs on machines with only torch and transformers: ``make gpu-check``)."""
    try:
        from rag_spec.paths import cache_dir

        return cache_dir() / "heads"
    except ImportError:
        return None


def load_head(model: Any, path: Path, fingerprint: str | None = None) -> DraftHead:
    """A head saved by ``cached_head`` for ``model`` (``fingerprint``: the model's, where the
    caller has it)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as file:
        meta = file.metadata()
        tensors = {k: file.get_tensor(k) for k in file.keys()}  # noqa: SIM118
    head = DraftHead(model, tensors["subset"], fingerprint)
    trained_for = meta.get("trained_for")
    if trained_for is not None and trained_for != head.trained_for:
        msg = (f"The draft head {path} was trained for another model (fingerprint "
               f"{trained_for}, this one {head.trained_for}): train one for this model with "
               "`rag-spec draft train --head`.")
        raise RagSpecError(msg)
    # (the LM head's rows are the model's); saved weights may be half precision
    head.load_state_dict({k: v for k, v in tensors.items() if k != "subset"}, strict=False)
    head.agreement = json.loads(meta["agreement"])
    return head.eval().requires_grad_(False)


def save_head(head: DraftHead, path: Path, dtype: torch.dtype | None = None) -> None:
    """What ``load_head`` reads: the trained weights (in ``dtype``, if given: a shipped head
    is half precision), the subset, the agreement and the model it was trained for."""
    from safetensors.torch import save_file

    state = {k: v.to(dtype) if dtype is not None and v.is_floating_point() else v
             for k, v in head.trained_state().items()}
    save_file({k: v.contiguous() for k, v in state.items()}, str(path),
              metadata={"agreement": json.dumps(head.agreement),
                        "trained_for": head.trained_for})
