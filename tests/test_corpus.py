"""Corpora: chunking, folders, standard-library docstrings, fingerprints."""

import pytest

from rag_spec.corpus import Passage, chunk, fingerprint, load_passages
from rag_spec.corpus.tokens import count_tokens
from rag_spec.errors import RagSpecError


def test_chunk_splits_on_word_count():
    passages = chunk("t", " ".join(f"w{i}" for i in range(250)), words=100)
    assert [len(p.text.split()) for p in passages] == [100, 100, 50]
    assert all(p.title == "t" for p in passages)


def test_folder_corpus_reads_text_files_only(tmp_path):
    (tmp_path / "a.md").write_text("alpha " * 20)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("beta " * 150)
    (tmp_path / "c.bin").write_text("gamma " * 20)
    passages = load_passages([str(tmp_path)])
    assert [p.title for p in passages] == ["a.md", "sub/b.txt", "sub/b.txt"]


def test_empty_folder_error_names_the_fix(tmp_path):
    with pytest.raises(RagSpecError, match="gave no passages"):
        load_passages([str(tmp_path)])


def test_missing_folder_error(tmp_path):
    with pytest.raises(RagSpecError, match="not a folder"):
        load_passages([str(tmp_path / "nope")])


def test_stdlib_corpus_is_real_and_deterministic():
    first = load_passages(["stdlib"])
    import faiss  # noqa: F401  (imports that patch the stdlib must not change the corpus)
    import transformers  # noqa: F401

    second = load_passages(["stdlib"])
    assert fingerprint(first) == fingerprint(second)
    assert len(first) > 2000
    titles = {p.title for p in first}
    assert {"json.loads", "posixpath.join", "collections.namedtuple"} <= titles


def test_installed_package_corpus():
    passages = load_passages(["pkg:email"])
    assert any(p.title.startswith("email.") for p in passages)


def test_fingerprint_sees_any_change():
    a = [Passage("t", "one two")]
    assert fingerprint(a) != fingerprint([Passage("t", "one three")])
    assert fingerprint(a) != fingerprint([Passage("u", "one two")])


def test_token_count_is_offline_cl100k():
    assert count_tokens(["hello world"]) == 2


def test_text_in_another_encoding_is_read_not_skipped(tmp_path, caplog):
    """Latin-1 Markdown and Python files are text: read in the encoding detected, and the
    log says which, instead of "not text"."""
    (tmp_path / "notes.md").write_bytes(
        "Le café crème coûte très cher à Zürich; été, naïve, façade. ".encode("latin-1") * 8)
    (tmp_path / "mod.py").write_bytes(
        '"""Gérer les données: lecture, écriture, mise à jour."""\n'.encode("latin-1") * 6)
    with caplog.at_level("INFO", logger="rag_spec.corpus.files"):
        passages = load_passages([str(tmp_path)])
    text = " ".join(p.text for p in passages)
    assert "café crème" in text and "données" in text
    assert {p.title for p in passages} == {"notes.md", "mod.py"}
    assert "is not UTF-8; read it as" in caplog.text and "not text" not in caplog.text
