"""The rag-spec command: user errors exit non-zero with one paragraph, no traceback."""

import pytest

from rag_spec.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_empty_question(capsys):
    code, _, err = run(capsys, "ask", "  ")
    assert code == 2
    assert "question is empty" in err
    assert "Traceback" not in err


def test_unknown_model(capsys):
    code, _, err = run(capsys, "ask", "hi", "--model", "no-such-model")
    assert code == 2
    assert "Embedded models: smollm2-135m-instruct" in err


def test_empty_corpus_folder(capsys, tmp_path):
    code, _, err = run(capsys, "index", "build", "--source", str(tmp_path), "--kind", "bm25")
    assert code == 2
    assert "gave no passages" in err


def test_corrupt_index(capsys, tmp_path):
    from rag_spec.retrieval.knowledge_base import corpus_dir

    (tmp_path / "a.txt").write_text("some words about python paths and files " * 3)
    assert run(capsys, "index", "build", "--source", str(tmp_path), "--kind", "bm25")[0] == 0
    (corpus_dir([str(tmp_path)]) / "bm25" / "meta.json").write_text("{not json")
    code, _, err = run(capsys, "index", "build", "--source", str(tmp_path), "--kind", "bm25")
    assert code == 2
    assert "--rebuild" in err


def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    assert "smollm2-135m-instruct" in out


@pytest.mark.parametrize("flag", ["--max-rows", "--max-waiting"])
def test_serve_refuses_caps_below_one(capsys, flag):
    code, _, err = run(capsys, "serve", flag, "0")
    assert code == 2 and f"{flag} must be at least 1" in err


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["ask", "--k"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize("content", [
    '["How do I sort?", "How do I join paths?"]',
    '"How do I sort?"\n"How do I join paths?"\n',
    '{"question": "How do I sort?"}\n\n{"question": "How do I join paths?"}\n',
])
def test_question_files_as_json_or_json_lines(tmp_path, content):
    from rag_spec.bench.prompts import load_questions

    path = tmp_path / "questions.jsonl"
    path.write_text(content)
    assert load_questions(str(path)) == ["How do I sort?", "How do I join paths?"]


@pytest.mark.parametrize("content, match", [("not json at all\n", "line 1: not JSON"),
                                            ('{"q": "x"}\n', "item 1 holds no question"),
                                            ("[]", "the file holds no question")])
def test_a_bad_questions_file_is_one_paragraph(capsys, tmp_path, content, match):
    path = tmp_path / "questions.jsonl"
    path.write_text(content)
    code, _, err = run(capsys, "bench", "ralm", "--questions", str(path))
    assert code == 2
    assert match in err and "Traceback" not in err


def test_draft_flags_are_checked_before_anything_loads(capsys, tiny_model_dir):
    for argv, match in ((("draft", "train", "--texts", "0"), "--texts must be at least 1"),
                        (("bench", "draft", "--layers", "0"), "--layers must be at least 1"),
                        (("bench", "batch", "--batch", "0"), "--batch must be at least 1"),
                        (("draft", "train", "--model", tiny_model_dir, "--layers", "5"),
                         "An exit needs 1 <= layers < 2")):
        code, _, err = run(capsys, *argv)
        assert code == 2 and match in err and "Traceback" not in err


def test_the_lookahead_bench_runs_the_model_it_is_given(capsys, monkeypatch):
    import rag_spec.bench.lookahead as lookahead

    given = {}
    monkeypatch.setattr(lookahead, "run", lambda **options: given.update(options))
    code, _, _ = run(capsys, "bench", "lookahead", "--model", "my/model", "--limit", "2")
    assert code == 0 and given["model_name"] == "my/model" and given["limit"] == 2
    run(capsys, "bench", "lookahead")
    assert given["model_name"] == "smollm2-135m-instruct" and given["peer"] is None
    run(capsys, "bench", "lookahead", "--peer", "llama.cpp")
    assert given["peer"] == "llama.cpp"


def test_the_llama_cpp_peer_is_left_out_in_one_line_where_it_cannot_run(capsys, monkeypatch,
                                                                      tmp_path):
    import sys

    from test_entry_matrix import char_lm
    from test_quantized import quantized_copy

    from rag_spec.bench.lookahead import _gguf_systems

    assert _gguf_systems(char_lm(), 8) == {}  # a model from no GGUF file
    assert capsys.readouterr().out.count("\n") == 1
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # not installed
    assert _gguf_systems(quantized_copy(char_lm(), tmp_path), 8) == {}
    assert "pip install llama-cpp-python" in capsys.readouterr().out


def test_the_gguf_systems_are_weighed_against_llama_cpps_faster_thread_count():
    from rag_spec.bench.lookahead import _summarise_gguf
    from rag_spec.bench.report import Run

    def runs(seconds, tokens):
        return [Run(s, t, {"peak_rss_mb": 100.0}) for s, t in zip(seconds, tokens)]

    same, other = [[1] * 10, [2] * 10], [[1] * 10, [3] * 10]
    report = _summarise_gguf({
        "gguf_rag_spec": runs([0.5, 0.5], same),  # 20 tok/s
        "gguf_rag_spec_no_drafts": runs([1.0, 1.0], same),  # 10
        "gguf_llama_cpp_1_thread": runs([2.0, 2.0], other),  # 5
        "gguf_llama_cpp_2_threads": runs([1.25, 1.25], other)})  # 8: the peer
    assert report["peer"] == "gguf_llama_cpp_2_threads"
    ours = report["systems"]["gguf_rag_spec"]
    assert (ours["speedup_vs_llama_cpp"], ours["speedup_vs_no_drafts"]) == (2.5, 2.0)
    assert ours["identical_to_no_drafts"] == 2
    assert report["systems"]["gguf_llama_cpp_1_thread"]["identical_to_no_drafts"] == 1


def test_the_batch_benchs_ablation_prefills_every_batch_as_one_padded_pass():
    # it once patched a constant the redesign had moved: the bench stopped at its start
    from rag_spec.bench.batch import padded_prefills
    from rag_spec.target.transformers.prefill import length_groups

    assert len(length_groups([8, 600])) == 2  # far apart: grouped
    with padded_prefills():
        assert length_groups([8, 600]) == [[0, 1]]


@pytest.mark.slow
def test_milvus_index_build_and_its_flags(capsys, tmp_path):
    pytest.importorskip("milvus_lite")
    from rag_spec.retrieval.milvus_lite import LiteServer

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("some words about python paths and files " * 3)
    source, uri = str(tmp_path / "notes"), str(tmp_path / "kb.db")
    try:
        code, out, _ = run(capsys, "index", "build", "--backend", "milvus", "--uri", uri,
                           "--source", source)
        assert code == 0 and "milvus: 1 passages, ready" in out
        code, _, err = run(capsys, "index", "build", "--backend", "milvus", "--uri", uri,
                           "--source", source, "--kind", "flat")
        assert code == 2 and "has a hnsw index, not flat" in err and "--rebuild" in err
    finally:
        LiteServer.serving(uri).stop()
    code, _, err = run(capsys, "index", "build", "--backend", "milvus", "--kind", "bm25")
    assert code == 2 and "local only" in err
    code, _, err = run(capsys, "index", "build", "--uri", uri)
    assert code == 2 and "add --backend milvus" in err
    code, _, err = run(capsys, "bench", "ralm", "--uri", uri)
    assert code == 2 and "--retriever milvus" in err


@pytest.mark.parametrize("flags, match", [(["--k", "0"], "--k must be at least 1"),
                                          (["--retriever", "approx", "--precision", "float16"],
                                           "float16 applies to exact")])
def test_knnlm_bench_flags_are_checked_before_anything_loads(capsys, flags, match):
    code, _, err = run(capsys, "bench", "knnlm", *flags)
    assert code == 2
    assert match in err and "Traceback" not in err


def test_the_clis_head_recipe_is_the_one_the_shipped_head_was_trained_by():
    """``rag-spec draft train --head`` and ``python -m lab.ship_head`` (``cached_head``'s
    defaults) must train the same head: a default that drifts in one of them would not."""
    import inspect

    from rag_spec.cli import _parser
    from rag_spec.training.train_head import cached_head

    args = _parser().parse_args(["draft", "train", "--head"])
    defaults = inspect.signature(cached_head).parameters
    for name in ("texts", "answers", "written"):
        assert getattr(args, name) == defaults[name].default, name


def test_ask_without_a_question_says_it_asks_the_demo_question(capsys):
    code, _, err = run(capsys, "ask", "--max-new-tokens", "0")  # stops before anything loads
    assert "no question given: asking the demo question" in err
    assert code == 2 and "--max-new-tokens must be at least 1" in err


def test_json_output_needs_the_schema_it_prints(capsys):
    code, _, err = run(capsys, "ask", "hi", "--json")
    assert code == 2 and "--json-schema FILE" in err and "Traceback" not in err


def test_draft_help_names_every_kind_and_the_default(capsys):
    with pytest.raises(SystemExit):
        main(["ask", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps lines at any hyphen
    for kind in ("early-exit:L", "trained-exit:L", "head", "self-spec:N", "drafthead+thetrie"):
        assert kind in text, kind


def test_served_asks_refuse_the_local_decoders_flags(capsys):
    code, _, err = run(capsys, "ask", "hi", "--served", "http://127.0.0.1:9", "--draft", "head",
                       "--float32")
    assert code == 2 and "--draft, --quantized / --float32 choose how a local model" in err
    code, _, err = run(capsys, "ask", "hi", "--api-key", "k")
    assert code == 2 and "--served URL" in err
