"""End to end on the real embedded model and default knowledge base (pulled/built on first use)."""

import pytest
import torch

from rag_spec.cli import main
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("user_cache")]

QUESTIONS = ["How do I join two path components with os.path?",
             "How do I parse a JSON string into a Python object?"]


@pytest.fixture(scope="module")
def lm():
    from rag_spec import load_model

    return load_model()


@pytest.fixture(scope="module")
def kb():
    from rag_spec import KnowledgeBase

    return KnowledgeBase.load_default("flat")


def test_default_knowledge_base_finds_the_documentation(user_cache, kb):
    hits = kb.search(QUESTIONS, k=3)
    assert "posixpath.join" in [h.title for h in hits[0]]
    assert any(h.title.startswith("json") for h in hits[1])


def test_rag_answers_equal_transformers_greedy(user_cache, lm, kb):
    from rag_spec.prompts import chat_input_ids, rag_messages

    decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(quantized=False))
    for question, hits in zip(QUESTIONS, kb.search(QUESTIONS, k=2)):
        prompt = chat_input_ids(lm.tokenizer, rag_messages(question, hits))
        expected = lm.model.generate(torch.tensor([prompt]), max_new_tokens=48,
                                     do_sample=False)[0, len(prompt):].tolist()
        result = decoder.generate(prompt, max_new_tokens=48)
        assert result.token_ids == expected
        assert result.stats.tokens_per_step > 1.0  # the passages were copied from
        # the embedded model ships its trained head: the default drafts with it and the trie
        assert result.stats.drafts == "draft head + trie"
        assert result.stats.weights == "float32"


def test_by_default_the_embedded_model_decodes_its_gguf_weights_as_its_own_no_draft_decoding(
        user_cache, lm, kb):
    """On a CPU whose kernels run, the default multiplies by the GGUF file's blocks, in steps
    compiled ahead of time (``make test`` builds them): greedy tokens equal that model's own
    decoding without drafts (another model than float32's: not ``generate``'s)."""
    from rag_spec.prompts import chat_input_ids, rag_messages
    from rag_spec_kernels import quantized_available, row_attention_available

    if not (quantized_available() and row_attention_available()):
        pytest.skip("the quantised kernels do not run on this CPU: the default is float32")
    decoder = LookaheadDecoder(lm.model, lm.tokenizer)
    plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0))
    for question, hits in zip(QUESTIONS, kb.search(QUESTIONS, k=2)):
        prompt = chat_input_ids(lm.tokenizer, rag_messages(question, hits))
        result = decoder.generate(prompt, max_new_tokens=48)
        assert result.token_ids == plain.generate(prompt, max_new_tokens=48).token_ids
        assert (result.stats.weights, result.stats.passes) == ("GGUF", "compiled ahead of time")


@pytest.mark.parametrize("text", ["hi", "Hello there"])
def test_a_prompt_of_one_or_two_tokens_is_generates(user_cache, lm, text):
    """A one-token prompt's first pass comes before any prefill: the compiled steps (built
    by `make test`, on float32 and on the GGUF file's weights) take it as the eager steps do."""
    prompt = lm.tokenizer(text, add_special_tokens=False)["input_ids"]
    result = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(quantized=False)
                              ).generate(prompt, max_new_tokens=8)
    expected = lm.model.generate(torch.tensor([prompt]), max_new_tokens=8,
                                 do_sample=False)[0, len(prompt):].tolist()
    assert result.token_ids == expected
    result = LookaheadDecoder(lm.model, lm.tokenizer).generate(prompt, max_new_tokens=8)
    plain = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0))
    assert result.token_ids == plain.generate(prompt, max_new_tokens=8).token_ids


def test_the_shipped_head_is_the_embedded_models_and_drafts_by_default(lm):
    from rag_spec.drafters.draft_head import SHIPPED, find_head, model_fingerprint

    shipped = SHIPPED / f"{model_fingerprint(lm.model)}.safetensors"
    assert shipped.is_file()  # the weights match the model (its fingerprint names them)
    head = find_head(lm.model)
    assert head is not None and head.trained_for == shipped.stem
    assert head.agreement["trained"]["top1"] > 0.25  # it learnt: held-out agreement


def test_ask_command_answers_and_cites(user_cache, lm, kb, capsys):
    assert main(["ask", QUESTIONS[0], "--max-new-tokens", "40"]) == 0
    out = capsys.readouterr().out
    assert "Sources:" in out
    assert "posixpath.join" in out
    assert "tok/s" in out
    assert "drafts: draft head + trie" in out


def test_knnlm_over_a_folder_is_identical_speculated(user_cache, lm, tmp_path):
    from rag_spec import KNNLM, KNNDatastore, KNNSpeculation
    from rag_spec.corpus import load_passages

    texts = [f"{p.title}\n{p.text}" for p in load_passages() if p.title.startswith("json.")]
    (tmp_path / "json.txt").write_text("\n\n".join(texts))
    store = KNNDatastore.open(lm, [str(tmp_path)], progress=False).with_distractors(60_000)
    naive, spec = KNNLM(lm, store, speculation=None), KNNLM(lm, store)
    # OS3 picks strides from timings (stride 1, a search per token, where searches are cheap
    # beside decoding), so fewer searches are asserted for a fixed stride
    fixed = KNNLM(lm, store, speculation=KNNSpeculation(os3=False, stride=4))
    for prompt in ("json.dumps\nSerialize ``obj`` to a JSON", "json.loads\nDeserialize"):
        expected = naive.generate(prompt, 24)
        assert spec.generate(prompt, 24).token_ids == expected.token_ids
        got = fixed.generate(prompt, 24)
        assert got.token_ids == expected.token_ids
        assert got.stats.kb_calls < expected.stats.kb_calls == 24


def test_json_extraction_from_retrieved_passages_equals_generate_with_xgrammar(user_cache, lm,
                                                                                kb):
    """The embedded model answers under a schema: valid JSON, constrained greedy's tokens."""
    import xgrammar as xgr

    from rag_spec.bench.structured import ApiRecord
    from rag_spec.engine.verify.grammar import GrammarRequest, Grammars
    from rag_spec.prompts import chat_input_ids

    decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(quantized=False))
    vocab = lm.model.get_input_embeddings().num_embeddings
    compiled = Grammars.of(lm.tokenizer, vocab, [lm.model.generation_config.eos_token_id]
                           ).compile(GrammarRequest(json_schema=ApiRecord))
    for question, hits in zip(QUESTIONS, kb.search(QUESTIONS, k=2)):
        passages = "\n\n".join(f"{h.title}: {h.text}" for h in hits)
        prompt = chat_input_ids(lm.tokenizer, [{"role": "user", "content": (
            f"Passages:\n{passages}\n\nQuestion: {question}\nGive the API as JSON.")}])
        ids = torch.tensor([prompt])
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=160,
                                logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
        expected = out[0, len(prompt):].tolist()
        eos = lm.model.generation_config.eos_token_id
        result = decoder.generate(prompt, 160, json_schema=ApiRecord)
        assert result.token_ids == expected[:expected.index(eos) + 1 if eos in expected else None]
        assert result.finish_reason == "eos"  # the schema bounds every string: it closes
        ApiRecord.model_validate_json(result.text)
        assert result.stats.tokens_per_step > 1.5  # copied names and forced keys


def test_ask_answers_under_a_json_schema_file(user_cache, capsys, tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"function": {"type": "string", '
                      '"maxLength": 40}}, "required": ["function"]}')
    code = main(["ask", "How do I join two path components with os.path?", "--json-schema",
                 str(schema), "--max-new-tokens", "60", "--json"])
    printed = capsys.readouterr()
    assert code == 0
    import json

    assert set(json.loads(printed.out)) == {"function"}  # standard output: the JSON alone
    assert "Sources:" in printed.err and "Q: How do I join" in printed.err
