"""Shared fixtures: tiny random-weight Llama models and a character tokenizer, built here."""

from __future__ import annotations

import hashlib
import os
import string
import threading

import numpy as np
import pytest
import torch

from rag_spec.retrieval.types import Hit

CHARS = string.ascii_lowercase + " .,!?\n"
USER_CACHE = os.environ.get("RAG_SPEC_CACHE")  # before the fixtures below redirect it
if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n 2: one worker a core, one thread each
    torch.set_num_threads(1)


# A tiny random model's shape, for any transformers family (its config's own names)
TINY_SHAPE = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256, "initializer_range": 0.3, "pad_token_id": 0}


def tiny_llama(seed: int = 0, vocab_size: int = 64, init: float = 0.3, layers: int = 2,
               eos: int | None = None, window: int = 256, hidden: int = 32):
    """A 2-layer Llama with grouped-query attention and peaked logits (few near ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=window, initializer_range=init, bos_token_id=1,
                         eos_token_id=eos, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


def counting(drafter_class: type) -> type:
    """``drafter_class`` counting the nodes it proposes (``proposed``): what a step verified
    is compared with it."""
    class Counting(drafter_class):
        proposed = 0

        def propose(self, requests, view):
            trees = super().propose(requests, view)
            self.proposed += sum(len(tree) for tree in trees)
            return trees

    return Counting


def char_tokenizer():
    """A character-level fast tokenizer: ids 0-2 special, then one id per character."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(CHARS)})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def char_lm(window: int = 256, seed: int = 5):
    """A tiny character-level Llama as a LoadedModel: what the RaLM loops take."""
    from rag_spec.models import LoadedModel

    tokenizer = char_tokenizer()
    model = tiny_llama(seed=seed, vocab_size=len(tokenizer), window=window)
    return LoadedModel(model, tokenizer, "tiny", torch.device("cpu"), torch.float32)


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny Llama and the character tokenizer saved as a model folder (what users pass)."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama(vocab_size=35, eos=2).save_pretrained(folder)  # 35: the tokenizer's size
    char_tokenizer().save_pretrained(folder)
    return str(folder)


@pytest.fixture(autouse=True)
def _private_cache(tmp_path_factory, monkeypatch):
    """Unit tests never touch the user's cache; e2e tests opt back in."""
    monkeypatch.setenv("RAG_SPEC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def user_cache(monkeypatch):
    """End-to-end tests share the real cache, so the model and index are built only once."""
    if USER_CACHE is None:
        monkeypatch.delenv("RAG_SPEC_CACHE")
    else:
        monkeypatch.setenv("RAG_SPEC_CACHE", USER_CACHE)


WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]


class SharedClock:
    """An injected clock (``IterativeRaLM.clock``), one time for every thread, moved on only by
    what waits on it (``wait``): a cost-driven choice is then the policy's, not this machine's
    timing."""

    now = 0.0

    def __call__(self):
        return self.now

    def wait(self, seconds):
        self.now += seconds


class VirtualClock(SharedClock, threading.local):
    """Each thread's own time, moved on only by what that thread waits for."""


class HashRetriever:
    """Deterministic scores from a hash of (query, passage); ``score`` is the same metric,
    unless ``lying`` makes the local scores disagree (forced mispredictions)."""

    def __init__(self, n: int = 40, lying: bool = False, raise_after: int | None = None,
                 stable: bool = False):
        self.texts = [" ".join(WORDS[(i * j) % len(WORDS)] for j in range(1, 6)) for i in range(n)]
        self.lying = lying
        self.calls = 0
        self.raise_after = raise_after
        self.stable = stable  # the same top passage for every query

    def _score(self, query: str, doc: int, salt: str = "") -> float:
        key = "" if self.stable else query[-6:]
        digest = hashlib.sha256(f"{salt}{key}|{doc % 7}".encode()).digest()
        return int.from_bytes(digest[:4], "big") / 2**32

    def search(self, queries, k=1):
        self.calls += 1
        if self.raise_after is not None and self.calls > self.raise_after:
            msg = "knowledge base is down"
            raise ConnectionError(msg)
        out = []
        for q in queries:
            scores = [self._score(q, d) for d in range(len(self.texts))]
            order = np.argsort(-np.asarray(scores), kind="stable")[:k]
            out.append([Hit(int(d), scores[d], f"doc{d}", self.texts[d]) for d in order])
        return out

    def score(self, queries, doc_ids):
        salt = "lie" if self.lying else ""
        return np.array([[self._score(q, d, salt) for d in doc_ids] for q in queries])


@pytest.fixture
def flat_step_costs(monkeypatch):
    """Every step width costs the same, so the decoder drafts whatever its drafts keep (a tiny
    model's step times are noise, and tests about what drafts do need them drafted)."""
    from rag_spec.policy.step_costs import StepCosts

    monkeypatch.setattr(StepCosts, "verify", lambda self, width: 1.0)
