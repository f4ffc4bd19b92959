"""Constrained output: greedy tokens are constrained greedy decoding's (transformers `generate`
with xgrammar's logits processor), sampled tokens follow the constrained distribution, drafts
the grammar forbids never reach the forward pass, and bad grammars fail before decoding."""

import functools
import json
import operator
import string

import pytest
import torch

from conftest import tiny_llama
from rag_spec.drafters.merged_drafter import MergedDrafter
from rag_spec.drafters.model_drafter import DraftModelDrafter
from rag_spec.engine.batch import LiveBatch
from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
from rag_spec.engine.verify.grammar import Constraint, GrammarRequest, Grammars
from rag_spec.errors import RagSpecError
from rag_spec.target.tree import TokenTree
from test_sampling import KNOBS, chi_square_ok

xgr = pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer"},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"]}
REGEX = r"(cat|dog) sat on the [a-z]{2,5}\."
EBNF = 'root ::= "yes" | "no" | "maybe " [a-z]+'
CHOICES = ["alpha", "beta", "gamma delta"]


def printable_tokenizer():
    """A character-level fast tokenizer over printable ASCII: JSON can be spelled with it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    vocab.update({c: i + 3 for i, c in enumerate(sorted(set(string.printable) - {"\x0b",
                                                                                 "\x0c"}))})
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


@pytest.fixture(scope="module")
def tok():
    return printable_tokenizer()


@pytest.fixture(scope="module")
def lm(tok):
    # an EOS the grammar's end allows; peaked logits keep near ties rare
    return tiny_llama(seed=4, vocab_size=len(tok), eos=2, init=0.4, window=1024)


def prompt(tok, text="the answer: "):
    return tok(text, add_special_tokens=False)["input_ids"]


def hf_constrained(model, tok, ids, compiled, max_new_tokens):
    """transformers `generate` under xgrammar's logits processor: the peer to equal."""
    processor = xgr.contrib.hf.LogitsProcessor(compiled)
    ids_t = torch.tensor([ids])
    out = model.generate(ids_t, attention_mask=torch.ones_like(ids_t), do_sample=False,
                         max_new_tokens=max_new_tokens, logits_processor=[processor])
    new = out[0, len(ids):].tolist()
    return new[:new.index(2) + 1] if 2 in new else new


def compiled_for(lm, tok, **kind):
    return Grammars.of(tok, lm.get_input_embeddings().num_embeddings, [2]).compile(
        GrammarRequest(**kind))


@pytest.mark.parametrize("kind", [{"json_schema": SCHEMA}, {"regex": REGEX}, {"grammar": EBNF},
                                  {"choices": CHOICES}])
@pytest.mark.parametrize("budget", [0, 4, 12])
def test_greedy_equals_generate_with_xgrammars_logits_processor(lm, tok, kind, budget):
    decoder = LookaheadDecoder(lm, tok, LookaheadConfig(budget=budget))
    for text in ("the answer: ", "{\"name\": ", "cat"):
        ids = prompt(tok, text)
        expected = hf_constrained(lm, tok, ids, compiled_for(lm, tok, **kind), 40)
        result = decoder.generate(ids, 40, **kind)
        assert result.token_ids == expected, (kind, text)
        assert result.finish_reason == ("eos" if expected[-1] == 2 else "length")


def test_drafts_of_the_grammars_own_text_are_accepted_and_outputs_stay_exact(lm, tok):
    """The forced continuation (jump-forward) is drafted: JSON keys and punctuation cost no
    pass of their own, and a trie that copies earlier answers adds more."""
    ids = prompt(tok)
    plain = LookaheadDecoder(lm, tok, LookaheadConfig(budget=0)).generate(ids, 60,
                                                                           json_schema=SCHEMA)
    decoder = ablated(lm, tok, LookaheadConfig(), adaptive=False)
    first = decoder.generate(ids, 60, json_schema=SCHEMA)
    again = decoder.generate(ids, 60, json_schema=SCHEMA)
    assert first.token_ids == again.token_ids == plain.token_ids
    assert max(first.stats.accepted_per_step) >= 4  # a forced key, verified as one chain
    assert again.stats.tokens_per_step > first.stats.tokens_per_step  # and the trie's memory
    text = tok.decode(plain.token_ids, skip_special_tokens=True)
    if plain.finish_reason == "eos":
        assert json.loads(text).keys() == SCHEMA["properties"].keys()
    else:  # cut short by the token limit: a prefix the grammar accepts, never more
        assert plain.finish_reason == "length" and text.lstrip().startswith("{")


def test_a_batch_mixes_grammars_and_free_rows(lm, tok):
    prompts = [prompt(tok, t) for t in ("the answer: ", "a dog ", "x")]
    decoder = LookaheadDecoder(lm, tok)
    kinds = {"json_schema": [SCHEMA, None, None], "regex": [None, REGEX, None]}
    batch = decoder.generate(prompts, 30, **kinds)
    alone = [decoder.generate(prompts[0], 30, json_schema=SCHEMA),
             decoder.generate(prompts[1], 30, regex=REGEX), decoder.generate(prompts[2], 30)]
    assert [r.token_ids for r in batch] == [r.token_ids for r in alone]


def test_drafts_the_grammar_forbids_are_cut_before_the_forward_pass(lm, tok):
    compiled = compiled_for(lm, tok, choices=CHOICES)
    constraint = Constraint(compiled, lm.get_input_embeddings().num_embeddings, tok)
    a, b, z = (tok.convert_tokens_to_ids(c) for c in "abz")
    # "al" is allowed, "b" then "e" too, "z" is not, nor anything under it
    tree = TokenTree.from_paths([[a, tok.convert_tokens_to_ids("l")], [b, a], [z, a]])
    kept = constraint.drafts(tree, budget=8)
    assert set(kept.tokens) <= {a, b, tok.convert_tokens_to_ids("l"),
                                tok.convert_tokens_to_ids("e")}
    assert z not in kept.tokens and (b, a) not in zip(kept.tokens, kept.tokens[1:])
    constraint.advance([b])  # after "b" the grammar forces "eta"
    forced = constraint.drafts(TokenTree.empty(), budget=8)
    assert tok.decode(list(forced.tokens)) == "eta"


def test_each_nodes_logits_are_masked_along_its_own_path(lm, tok):
    compiled = compiled_for(lm, tok, choices=["ab", "cd"])
    constraint = Constraint(compiled, lm.get_input_embeddings().num_embeddings, tok)
    a, b, c, d = (tok.convert_tokens_to_ids(x) for x in "abcd")
    tree = TokenTree.from_paths([[a], [c]])
    masked = constraint.apply(torch.zeros(3, lm.get_input_embeddings().num_embeddings),
                              constraint.masks(tree))
    allowed = [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in masked]
    assert allowed == [{a, c}, {b}, {d}]


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["trie", "draft model"])
@pytest.mark.parametrize("name", list(KNOBS))
def test_sampling_follows_the_constrained_distribution(lm, tok, drafter, name):
    knobs = KNOBS[name]
    regex = r"[a-h][a-p]"
    ids = prompt(tok)
    make = {"trie": lambda: None,
            "draft model": lambda: MergedDrafter(DraftModelDrafter(
                tiny_llama(seed=5, vocab_size=len(tok), eos=2)), eager=True)}
    decoder = ablated(lm, tok, LookaheadConfig(), drafter=make[drafter](), adaptive=False)
    greedy = decoder.generate(ids, 2, regex=regex).token_ids
    decoder.drafter.trie.remember(ids + greedy) if drafter == "draft model" else \
        decoder.drafter.remember(ids + greedy)  # drafts that often match
    n = 3000
    results = decoder.generate([ids] * n, 2, do_sample=True, seed=7, regex=regex, **knobs)
    first, second = constrained_marginals(lm, tok, ids, regex, knobs)
    for position, probs in ((0, first), (1, second)):
        stat, bound = chi_square_ok([r.token_ids[position] for r in results], probs)
        assert stat < bound, (position, stat, bound)
    unmasked, _ = constrained_marginals(lm, tok, ids, r"[a-p][a-p]", knobs)  # power check
    stat, bound = chi_square_ok([r.token_ids[0] for r in results], unmasked)
    assert stat > bound


def constrained_marginals(lm, tok, ids, regex, knobs):
    """P(first token), P(second token) under the grammar's masks, then the knobs (mask first,
    as vLLM does): transformers' own warpers on masked logits."""
    from transformers.generation.logits_process import (
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    vocab = lm.get_input_embeddings().num_embeddings
    compiled = compiled_for(lm, tok, regex=regex)

    def probs(context):
        constraint = Constraint(compiled, vocab, tok)
        constraint.advance(context[len(ids):])
        with torch.no_grad():
            logits = lm(torch.tensor([context])).logits[:, -1].float()
        logits = constraint.apply(logits, constraint.masks(TokenTree.empty()))
        logits = TemperatureLogitsWarper(knobs["temperature"])(None, logits)
        if "top_k" in knobs:
            logits = TopKLogitsWarper(knobs["top_k"])(None, logits)
        if "top_p" in knobs:
            logits = TopPLogitsWarper(knobs["top_p"])(None, logits)
        return logits.softmax(-1)[0]

    first = probs(ids)
    second = sum(p * probs(ids + [t]) for t, p in enumerate(first.tolist()) if p > 0)
    return first, second


@pytest.mark.parametrize("kind, match", [
    ({"json_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
     "json schema does not compile"),
    ({"json_schema": 3}, "json_schema takes a dict, a JSON string or a Pydantic model"),
    ({"regex": "(unclosed"}, "regex does not compile"),
    ({"grammar": "start ::= oops"}, "grammar does not compile.*root ::="),
    ({"choices": []}, "choices takes a list of non-empty strings"),
    ({"choices": ["a", ""]}, "choices takes a list of non-empty strings"),
    ({"regex": "a", "choices": ["a"]}, "Give one of json_schema, regex, grammar or choices"),
    ({"regex": ["a", "b"]}, "regex has 2 entries for 1 prompts"),
])
def test_bad_grammars_fail_before_any_decoding(lm, tok, kind, match, monkeypatch):
    decoder = LookaheadDecoder(lm, tok)
    monkeypatch.setattr(LiveBatch, "join", lambda *a, **k: pytest.fail("decoded"))
    with pytest.raises(RagSpecError, match=match):
        decoder.generate(prompt(tok), 5, **kind)


def test_a_pydantic_model_is_a_schema(lm, tok):
    from pydantic import BaseModel

    class Item(BaseModel):
        name: str
        n: int

    decoder = LookaheadDecoder(lm, tok)
    ids = prompt(tok)
    expected = hf_constrained(lm, tok, ids, compiled_for(lm, tok, json_schema=Item), 40)
    assert decoder.generate(ids, 40, json_schema=Item).token_ids == expected


def test_constrained_output_needs_a_tokenizer(lm):
    with pytest.raises(RagSpecError, match="constrained output needs a tokenizer"):
        LookaheadDecoder(lm).generate([5, 6, 7], 5, regex="a+")


@pytest.mark.parametrize("content, match", [(None, "cannot read a JSON schema there"),
                                            ("[1, 2]", "a JSON schema is an object"),
                                            ("{not json", "cannot read a JSON schema there")])
def test_a_bad_json_schema_file_is_refused_before_anything_loads(capsys, monkeypatch, tmp_path,
                                                                 content, match):
    import rag_spec.models.loader as loader
    from rag_spec.cli import main

    monkeypatch.setattr(loader, "load_model", lambda *a, **k: pytest.fail("loaded a model"))
    path = tmp_path / "schema.json"
    if content is not None:
        path.write_text(content)
    code = main(["ask", "hi", "--json-schema", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and match in err and "Traceback" not in err


def test_a_schema_the_tokenizer_cannot_spell_stops_before_the_answer(capsys, monkeypatch,
                                                                     tmp_path, tiny_model_dir):
    import rag_spec.retrieval.knowledge_base as knowledge_base
    from conftest import HashRetriever
    from rag_spec.cli import main

    store = HashRetriever()
    store.kind = "hash"
    monkeypatch.setattr(knowledge_base.KnowledgeBase, "open", classmethod(lambda *a, **k: store))
    path = tmp_path / "schema.json"
    path.write_text('{"type": "object", "properties": {"a": {"type": "integer"}}}')
    code = main(["ask", "hi", "--model", tiny_model_dir, "--json-schema", str(path)])
    captured = capsys.readouterr()
    assert code == 2 and "A:" not in captured.out
    assert "allows no token of this tokenizer" in captured.err


# -- LangChain: with_structured_output ------------------------------------------------------------

@pytest.fixture(scope="module")
def printable_dir(tmp_path_factory, tok, lm):
    """The tiny model and the printable tokenizer, with a chat template, as a model folder."""
    folder = tmp_path_factory.mktemp("printable")
    lm.save_pretrained(folder)
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
@pytest.mark.parametrize("kind", ["pydantic", "typeddict", "dict"])
def test_with_structured_output_parses_what_the_grammar_allowed(printable_dir, method, kind):
    from typing import TypedDict

    from pydantic import BaseModel

    from langchain_rag_spec import ChatLookahead

    class Item(BaseModel):
        """An item."""

        name: str
        n: int

    class ItemDict(TypedDict):
        """An item."""

        name: str
        n: int

    schema = {"pydantic": Item, "typeddict": ItemDict,
              "dict": {"title": "Item", "description": "An item.", "type": "object",
                       "properties": {"name": {"type": "string", "maxLength": 4},
                                      "n": {"type": "integer", "maximum": 99}},
                       "required": ["name", "n"]}}[kind]
    chat = ChatLookahead(model=printable_dir, max_tokens=300)
    structured = chat.with_structured_output(schema, method=method, include_raw=True)
    out = structured.invoke("the item: ")
    raw = out["raw"]
    if raw.response_metadata["finish_reason"] == "length":  # cut short: never parsed
        assert out["parsed"] is None and "cut at max_tokens" in str(out["parsing_error"])
        return
    if method == "json_mode":  # any JSON object: the schema only parses it
        assert isinstance(json.loads(raw.content), dict)
        if out["parsing_error"] is not None:
            assert kind == "pydantic" and out["parsed"] is None
            return
    assert out["parsing_error"] is None
    parsed = out["parsed"]
    if kind == "pydantic":
        assert isinstance(parsed, Item)
    elif method == "json_schema":
        assert set(parsed) == {"name", "n"} and isinstance(parsed["n"], int)
    else:
        assert isinstance(parsed, dict)
    value = raw.tool_calls[0]["args"] if method == "function_calling" else json.loads(
        raw.content)
    assert value == (parsed.model_dump() if kind == "pydantic" else parsed)


def test_a_structured_answer_cut_at_max_tokens_is_an_error_not_a_value(printable_dir):
    from langchain_core.exceptions import OutputParserException

    from langchain_rag_spec import ChatLookahead

    chat = ChatLookahead(model=printable_dir, max_tokens=3)
    with pytest.raises(OutputParserException, match="cut at max_tokens"):
        chat.with_structured_output({"title": "T", "type": "object", "properties": {
            "a": {"type": "string"}}, "required": ["a"]}).invoke("x")
    with pytest.raises(ValueError, match="method must be 'json_schema' .*, 'function_calling'"):
        chat.with_structured_output({"type": "object"}, method="xml")


# -- tool calling ----------------------------------------------------------------------------------

def magic_function(input: int) -> int:  # noqa: A002 (LangChain's standard suite's tool)
    """Apply a magic function to an input."""
    return input + 2


def weather(city: str, unit: str = "c") -> str:
    """The weather in a city."""
    return f"sunny in {city}"


@pytest.mark.parametrize("choice", ["any", "required", "magic_function"])
def test_a_forced_tool_call_always_parses_with_arguments_of_its_schema(printable_dir, choice):
    from langchain_rag_spec import ChatLookahead

    chat = ChatLookahead(model=printable_dir, max_tokens=120)
    bound = chat.bind_tools([magic_function, weather], tool_choice=choice)
    called = 0
    for question in ("what is magic of 3?", "weather in paris"):
        message = bound.invoke(question)
        if message.response_metadata["finish_reason"] == "length":
            # cut short: whole calls are presented, an unfinished one stays text
            assert message.content.startswith("<tool_call>") or not message.content
        else:
            assert message.tool_calls and not message.content  # calls, nothing else
        called += bool(message.tool_calls)
        for call in message.tool_calls:
            assert call["id"].startswith("call_")
            if choice == "magic_function" or call["name"] == "magic_function":
                assert call["name"] == "magic_function" and isinstance(call["args"]["input"],
                                                                      int)
            else:
                assert call["name"] == "weather" and isinstance(call["args"]["city"], str)
    assert called  # the random model's calls closed within max_tokens


def test_auto_tool_choice_answers_or_calls_and_histories_render(printable_dir):
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage

    from langchain_rag_spec import ChatLookahead

    chat = ChatLookahead(model=printable_dir, max_tokens=60)
    bound = chat.bind_tools([magic_function])
    message = bound.invoke("hello")
    assert isinstance(message.content, str)
    assert all(c["name"] == "magic_function" for c in message.tool_calls)
    history = [HumanMessage("magic of 3?"),
               AIMessage("", tool_calls=[{"name": "magic_function", "args": {"input": 3},
                                          "id": "call_1"}]),
               ToolMessage("5", tool_call_id="call_1")]
    assert isinstance(bound.invoke(history).content, str)
    streamed = list(chat.bind_tools([magic_function], tool_choice="any").stream("magic of 3"))
    last = streamed[-1]
    if last.response_metadata.get("finish_reason") != "length":
        (call,) = last.tool_call_chunks[:1]
        assert call["name"] == "magic_function" and "input" in json.loads(call["args"])


def test_tools_are_rendered_through_a_chat_template_that_has_a_tools_section(tok):
    from rag_spec.serving.tools import Tool, template_has_tools

    plain = printable_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert not template_has_tools(plain)
    plain.chat_template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }}"
                           "{% endfor %}\n{% endif %}{% for m in messages %}{{ m['content'] }}"
                           "{% endfor %}")
    assert template_has_tools(plain)
    assert Tool("f").openai()["function"]["name"] == "f"


@pytest.mark.parametrize("tools, choice, match", [
    ([{"type": "function", "function": {"name": "bad name!", "parameters": {}}}], "auto",
     "cannot be called"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     "auto", "must be a JSON schema of an object"),
    ([magic_function], "nope", "names no bound tool"),
])
def test_bad_tools_are_refused_when_bound(printable_dir, tools, choice, match):
    from langchain_rag_spec import ChatLookahead

    with pytest.raises(RagSpecError, match=match):
        ChatLookahead(model=printable_dir).bind_tools(tools, tool_choice=choice)


# -- LlamaIndex: a function-calling LLM ----------------------------------------------------------

def test_lookahead_llm_calls_tools_and_predicts_structures(printable_dir):
    from llama_index.core import PromptTemplate
    from llama_index.core.llms import ChatMessage
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.rag_spec import LookaheadLLM
    from pydantic import BaseModel

    llm = LookaheadLLM(model=printable_dir, max_new_tokens=120)
    assert llm.metadata.is_function_calling_model
    tool = FunctionTool.from_defaults(fn=magic_function)
    response = llm.chat_with_tools([tool], user_msg="magic of 3", tool_required=True)
    if response.additional_kwargs["finish_reason"] != "length":
        (selection,) = llm.get_tool_calls_from_response(response)
        assert selection.tool_name == "magic_function"
        assert isinstance(selection.tool_kwargs["input"], int)
        output = llm.predict_and_call([tool], user_msg="magic of 3", tool_required=True)
        assert output.sources[0].raw_output == selection.tool_kwargs["input"] + 2 or \
            output.sources[0].tool_name == "magic_function"
    history = [ChatMessage(role="user", content="magic of 3"),
               ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
                   {"id": "call_1", "name": "magic_function", "arguments": {"input": 3}}]}),
               ChatMessage(role="tool", content="5")]
    assert isinstance(llm.chat(history).message.content, str)

    class Item(BaseModel):
        """An item."""

        name: str
        n: int

    llm = LookaheadLLM(model=printable_dir, max_new_tokens=200)
    try:
        item = llm.structured_predict(Item, PromptTemplate("the item {x}: "), x="a")
    except ValueError as err:  # cut at max_new_tokens: no value, an error
        assert "tool call" in str(err) or "Expected" in str(err)
    else:
        assert isinstance(item, Item) and isinstance(item.n, int)


def test_results_come_back_as_the_users_turn_named_after_their_tool_without_a_tools_section():
    from rag_spec.serving.tools import GENERIC, Tool, ToolCall, chat_messages

    tool = Tool("add", "Add.", {"type": "object", "properties": {"a": {"type": "integer"}}})
    asked = [ToolCall("add", {"a": 3}, id="c1"), ToolCall("add", {"a": 5}, id="c2")]
    messages = chat_messages([{"role": "user", "content": "3 + 4?"},
                              {"role": "assistant", "content": "", "tool_calls": asked},
                              {"role": "tool", "content": "7", "tool_call_id": "c1"},
                              {"role": "tool", "content": "9"}], [tool], form=GENERIC,
                             native=False)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    assert messages[2]["content"] == GENERIC.render(asked)  # as the model wrote them
    assert messages[3]["content"] == "<tool_response>add: 7</tool_response>"
    assert messages[4]["content"] == "<tool_response>9</tool_response>"
    assert "<tool_response>" in messages[0]["content"]


def test_both_adapters_hand_on_calls_and_the_id_a_result_answers():
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.rag_spec.base import _chat as llama_index_chat

    from langchain_rag_spec.chat_models import chat_turns as langchain_chat
    from rag_spec.serving.tools import ToolCall

    call = ToolCall("add", {"a": 3}, id="c1")
    asked = AIMessage("", tool_calls=[{"id": "c1", "name": "add", "args": {"a": 3}}])
    turns = langchain_chat([HumanMessage("3?"), asked, ToolMessage("7", tool_call_id="c1")])
    assert turns[1]["tool_calls"] == [call]
    assert turns[2] == {"role": "tool", "content": "7", "tool_call_id": "c1"}
    turns = llama_index_chat([ChatMessage(role="user", content="3?"),
                              ChatMessage(role="assistant", content="", additional_kwargs={
                                  "tool_calls": [{"id": "c1", "name": "add",
                                                  "arguments": {"a": 3}}]}),
                              ChatMessage(role="tool", content="7",
                                          additional_kwargs={"tool_call_id": "c1"})])
    assert turns[1]["tool_calls"] == [call]
    assert turns[2] == {"role": "tool", "content": "7", "tool_call_id": "c1"}


def test_the_masks_are_filled_while_the_pass_runs(lm, tok, monkeypatch):
    """On an accelerator a forward call returns before the pass ends: each step fills its
    grammar's masks between the launch and the wait for the pass (as vLLM fills its
    bitmasks), so a constrained step costs the longer of the two, not their sum."""
    import rag_spec.engine.batch as batch_module
    from rag_spec.target.transformers.runner import Runner

    events = []
    forward, masks = Runner.forward, Constraint.masks
    monkeypatch.setattr(Runner, "forward", lambda self, *a, **k: events.append("launch")
                        or forward(self, *a, **k))
    monkeypatch.setattr(Constraint, "masks", lambda self, tree: events.append("masks")
                        or masks(self, tree))
    monkeypatch.setattr(batch_module, "settle", lambda device: events.append("wait"))
    result = LookaheadDecoder(lm, tok).generate(prompt(tok), 24, json_schema=SCHEMA)
    steps = [events[i:i + 3] for i, e in enumerate(events) if e == "launch"]
    assert len(steps) >= result.stats.steps > 1
    assert steps[-result.stats.steps:] == [["launch", "masks", "wait"]] * result.stats.steps


# -- answers that hold up: compact JSON, cut answers said, one string is no list of choices -------

def test_json_allows_one_free_whitespace_by_default_compact_or_laid_out_on_request(lm, tok):
    """A grammar that allows any whitespace lets a small model spend its tokens on newlines
    and never close the object; one that allows none makes it run free strings on where it
    would close them after a newline: the default allows one whitespace character a place
    (lab.json_layouts measured both on the embedded model). ``whitespace=0`` is compact; an
    indent lays it out on fixed lines. Either way the tokens are constrained generate's on
    the same grammar."""
    from rag_spec import JsonSchema

    default = Constraint(compiled_for(lm, tok, json_schema=SCHEMA), len(tok), tok).matcher
    assert default.accept_string('{\n"name": "ab",')
    assert not default.accept_string(' \n')  # two in a row
    compact = Constraint(compiled_for(lm, tok, json_schema=JsonSchema(SCHEMA, whitespace=0)),
                         len(tok), tok).matcher
    assert not compact.accept_string('{\n')
    assert compact.accept_string('{"name": "ab", "n": 1, "ok": true}') and compact.is_completed()
    pretty = compiled_for(lm, tok, json_schema=JsonSchema(SCHEMA, indent=2))
    assert Constraint(pretty, len(tok), tok).matcher.accept_string('{\n  "name": "ab",\n')
    decoder = LookaheadDecoder(lm, tok, LookaheadConfig(budget=8))
    ids = prompt(tok, '{"name": ')
    for layout in (JsonSchema(SCHEMA, indent=2), SCHEMA):
        result = decoder.generate(ids, 40, json_schema=layout)
        grammar = compiled_for(lm, tok, json_schema=layout)
        assert result.token_ids == hf_constrained(lm, tok, ids, grammar, 40)


def test_an_answer_cut_before_its_grammar_closes_says_so(lm, tok):
    from rag_spec import IncompleteOutputWarning

    decoder = LookaheadDecoder(lm, tok, LookaheadConfig(budget=8))
    ids = prompt(tok)
    with pytest.warns(IncompleteOutputWarning, match="Raise max_new_tokens") as caught:
        cut = decoder.generate([ids, ids], 3, json_schema=SCHEMA)
    assert caught[0].filename == __file__  # pointed at the caller's line
    assert all(r.incomplete and r.finish_reason == "length" for r in cut)
    with pytest.warns(IncompleteOutputWarning):
        stream = decoder.stream(ids, 3, json_schema=SCHEMA)
        assert "".join(stream) == cut[0].text
    assert stream.result.incomplete
    closed = decoder.generate(ids, 2, choices=["ab", "abc"])  # "ab" may end there
    assert not closed.incomplete and closed.text == "ab"
    assert not decoder.generate(ids, 3).incomplete  # free text is never cut short of a grammar


def test_choices_refuses_a_bare_string(lm, tok):
    decoder = LookaheadDecoder(lm, tok)
    with pytest.raises(RagSpecError, match=r"choices=\['yes'\]"):
        decoder.generate(prompt(tok), 4, choices="yes")


def test_a_forced_tool_call_cut_at_max_tokens_is_an_invalid_call(printable_dir):
    from langchain_rag_spec import ChatLookahead

    bound = ChatLookahead(model=printable_dir, max_tokens=45).bind_tools(
        [magic_function], tool_choice="magic_function")
    invoked = bound.invoke("magic of 3")
    streamed = functools.reduce(operator.add, bound.stream("magic of 3"))
    for message in (invoked, streamed):
        assert message.response_metadata["finish_reason"] == "length"
        assert not message.tool_calls and not message.content  # no answer an agent would take
        (invalid,) = message.invalid_tool_calls
        assert invalid["name"] == "magic_function"  # forced: named before the model wrote it
        assert "<tool_call>" not in invalid["args"] and '"name"' not in invalid["args"]
        assert "raise max_tokens" in invalid["error"]
    assert streamed.invalid_tool_calls == invoked.invalid_tool_calls  # the same entry


def test_llama_index_forces_structured_programs_and_names_a_cut_call(printable_dir):
    from llama_index.core import PromptTemplate
    from llama_index.core.tools import FunctionTool
    from llama_index.llms.rag_spec import LookaheadLLM
    from pydantic import BaseModel

    class Item(BaseModel):
        """An item."""

        n: int

    llm = LookaheadLLM(model=printable_dir, max_new_tokens=120)
    tool = FunctionTool.from_defaults(fn=magic_function)
    # FunctionCallingProgram passes tool_choice=None with tool_required=True
    assert llm._prepare_chat_with_tools([tool], "x", tool_choice=None, tool_required=True)[
        "tool_choice"] == "required"
    item = llm.structured_predict(Item, PromptTemplate("the item {x}: "), x="a")
    assert isinstance(item, Item)  # the call was forced: a random model's prose is no call
    assert isinstance(llm.as_structured_llm(Item).complete("an item").raw, Item)
    short = LookaheadLLM(model=printable_dir, max_new_tokens=8)
    with pytest.raises(ValueError, match="cut at max_new_tokens before it closed"):
        short.predict_and_call([tool], user_msg="magic of 3", tool_required=True)
