"""Shared fixtures: tiny random-weight Llama models and a character tokenizer, built here."""

from __future__ import annotations

import os
import string

import pytest
import torch

CHARS = string.ascii_lowercase + " .,!?\n"
USER_CACHE = os.environ.get("RAG_SPEC_CACHE")  # before the fixtures below redirect it


def tiny_llama(seed: int = 0, vocab_size: int = 64, init: float = 0.3, layers: int = 2,
               eos: int | None = None):
    """A 2-layer Llama with grouped-query attention and peaked logits (few near ties)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=init, bos_token_id=1,
                         eos_token_id=eos, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    return model


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


@pytest.fixture(scope="session")
def model():
    return tiny_llama()


@pytest.fixture(scope="session")
def tokenizer():
    return char_tokenizer()


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
