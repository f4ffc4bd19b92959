"""Each model family's own tool-call format, on tiny random models of three families with chat
templates written here after the families' own (Qwen 2.5's ``<tool_call>`` blocks, Llama
3.1's bare JSON with ``"parameters"``, Mistral v0.3's ``[TOOL_CALLS]`` array and 9-character
call ids): the format is read from the template, a forced call decodes as ``generate`` with
xgrammar's logits processor does and parses, histories with calls and results render through
the template, and the "auto" grammar takes text, calls, or both, never a broken call."""

import pytest
import torch
import transformers
from test_structured import compiled_for, hf_constrained, printable_tokenizer

from rag_spec.engine.decoder import ablated
from rag_spec.models import LoadedModel
from rag_spec.serving.local_lm import GenerateOptions, LocalLM
from rag_spec.serving.tools import (
    GENERIC,
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    Tool,
    ToolCall,
    call_format,
    options_grammar,
    tool_options,
)

xgr = pytest.importorskip("xgrammar")

QWEN_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are helpful.{% endif %}

# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == "assistant" %}<|im_start|>assistant
{% if message.content %}{{ message.content }}{% endif %}
{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}\
{% if loop.first or messages[loop.index0 - 1].role != "tool" %}<|im_start|>user{% endif %}
<tool_response>
{{ message.content }}
</tool_response>\
{% if loop.last or messages[loop.index0 + 1].role != "tool" %}<|im_end|>
{% endif %}{% endif %}{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_TEMPLATE = """\
{%- if not tools is defined %}{% set tools = none %}{% endif %}
{%- if messages[0].role == 'system' %}{% set system_message = messages[0].content | trim %}\
{% set messages = messages[1:] %}{% else %}{% set system_message = "" %}{% endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{ "Environment: ipython\\n" }}{% endif %}
{{- system_message }}{{ "<|eot_id|>" }}
{%- if tools is not none %}{% set first_user_message = messages[0].content | trim %}\
{% set messages = messages[1:] %}
{{- "<|start_header_id|>user<|end_header_id|>\\n\\nGiven the following functions, please \
respond with a JSON for a function call with its proper arguments that best answers the given \
prompt.\\n\\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name \
and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{ t | tojson(indent=4) }}{{ "\\n\\n" }}{% endfor %}
{{- first_user_message + "<|eot_id|>" }}{% endif %}
{%- for message in messages %}
{%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content | trim \
+ '<|eot_id|>' }}
{%- elif 'tool_calls' in message %}
{%- if not message.tool_calls | length == 1 %}\
{{ raise_exception("This model only supports single tool-calls at once!") }}{% endif %}
{%- set tool_call = message.tool_calls[0].function %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + "}" }}
{{- "<|eot_id|>" }}
{%- elif message.role == "tool" or message.role == "ipython" %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
{%- endif %}{% endfor %}
{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\
{% endif %}"""

MISTRAL_TEMPLATE = """\
{%- if messages[0]["role"] == "system" %}{% set system_message = messages[0]["content"] %}\
{% set loop_messages = messages[1:] %}{% else %}{% set loop_messages = messages %}{% endif %}
{%- if not tools is defined %}{% set tools = none %}{% endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
{%- if message["role"] == "user" %}
{%- if tools is not none and (message == user_messages[-1]) %}{{ "[AVAILABLE_TOOLS] [" }}\
{% for tool in tools %}{{ tool | tojson }}{% if not loop.last %}{{ ", " }}{% endif %}\
{% endfor %}{{ "][/AVAILABLE_TOOLS]" }}{% endif %}
{%- if loop.last and system_message is defined %}\
{{ "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}\
{% else %}{{ "[INST] " + message["content"] + "[/INST]" }}{% endif %}
{%- elif message.tool_calls is defined and message.tool_calls is not none %}
{{- "[TOOL_CALLS] [" }}
{%- for tool_call in message.tool_calls %}{% set out = tool_call.function | tojson %}\
{{ out[:-1] }}
{%- if not tool_call.id is defined or tool_call.id | length != 9 %}\
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- ', "id": "' + tool_call.id + '"}' }}{% if not loop.last %}{{ ", " }}\
{% else %}{{ "]" + eos_token }}{% endif %}{% endfor %}
{%- elif message["role"] == "assistant" %}{{ " " + message["content"] | trim + eos_token }}
{%- elif message["role"] == "tool" %}\
{{ '[TOOL_RESULTS] {"content": ' + message.content | string + ", " }}
{%- if not message.tool_call_id is defined or message.tool_call_id | length != 9 %}\
{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{{- '"call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}{% endfor %}"""

FAMILIES = {  # name: (config, model, template, the format it speaks)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", QWEN_TEMPLATE, HERMES),
    "llama": ("LlamaConfig", "LlamaForCausalLM", LLAMA_TEMPLATE, LLAMA3_JSON),
    "mistral": ("MistralConfig", "MistralForCausalLM", MISTRAL_TEMPLATE, MISTRAL),
}
WEATHER = Tool("weather", "The weather in a city.", {
    "type": "object", "properties": {"city": {"enum": ["paris", "rome"]},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]})
ALARM = Tool("alarm", "Set the alarm.", {"type": "object", "properties": {
    "on": {"type": "boolean"}}, "required": ["on"]})
TOOLS = [WEATHER.openai(), ALARM.openai()]


def family_lm(family: str) -> LoadedModel:
    config_name, model_name, template, _ = FAMILIES[family]
    tok = printable_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})  # as Mistral's
    tok.chat_template = template
    torch.manual_seed(3)
    config = getattr(transformers, config_name)(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=0.4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    model = getattr(transformers, model_name)(config).eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 0
    return LoadedModel(model, tok, family, torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    return request.param, family_lm(request.param)


def valid(call: ToolCall) -> bool:
    if call.name == "weather":
        return call.arguments in [{"city": c, "unit": u} for c in ("paris", "rome")
                                  for u in ("c", "f")]
    return call.name == "alarm" and isinstance(call.arguments.get("on"), bool)


def test_the_format_is_read_from_the_template(family):
    name, lm = family
    assert call_format(lm.tokenizer) is FAMILIES[name][3]
    plain = printable_tokenizer()
    plain.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert call_format(plain) is GENERIC  # no tools section: the documented format


@pytest.mark.parametrize("choice", ["any", "weather"])
def test_a_forced_call_decodes_as_generate_with_the_grammar_and_parses(family, choice):
    name, lm = family
    local = LocalLM(lm)
    local.decoder = ablated(lm.model, lm.tokenizer, adaptive=False)  # every node verified
    options = GenerateOptions(max_new_tokens=160, **tool_options(TOOLS, choice))
    grammar = options_grammar(local.call_format, options.tools, options.tool_choice, False)
    compiled = compiled_for(lm.model, lm.tokenizer, grammar=grammar)
    for question in ("weather in paris?", "wake me up"):
        prompt = [{"role": "user", "content": question}]
        ids = local.encode(prompt, options.tools)
        assert "weather" in lm.tokenizer.decode(ids)  # the template offered the tools
        done = local.generate([prompt], options)[0]
        assert done.token_ids == hf_constrained(lm.model, lm.tokenizer, ids, compiled, 160)
        # one call and nothing else: the grammar ends there, so the answer does too
        assert done.finish_reason == "eos" and done.content == ""
        (call,) = done.calls
        assert valid(call) and (choice == "any" or call.name == "weather")
        assert len(call.id) == 9 if name == "mistral" else call.id.startswith("call_")


def test_parallel_calls_where_the_family_writes_them(family):
    name, lm = family
    local = LocalLM(lm)
    options = GenerateOptions(max_new_tokens=300, **tool_options(TOOLS, "any", parallel=True))
    done = local.generate([[{"role": "user", "content": "weather in rome and paris"}]],
                          options)[0]
    assert done.calls and all(valid(c) for c in done.calls)
    if FAMILIES[name][3] is LLAMA3_JSON:  # Llama 3.1's template holds one call an answer
        assert len(done.calls) == 1 and done.finish_reason == "eos"


def test_a_history_of_calls_and_results_renders_through_the_template(family):
    name, lm = family
    local = LocalLM(lm)
    call = ToolCall("weather", {"city": "rome", "unit": "c"}, id="call_7")
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "weather in rome?"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "content": "sunny", "tool_call_id": "call_7"}]
    text = lm.tokenizer.decode(local.encode(history, tool_options(TOOLS)["tools"]))
    written = {"qwen2": '<tool_call>\n{"name": "weather", "arguments": {"city": "rome", '
                        '"unit": "c"}}\n</tool_call>',
               "llama": '{"name": "weather", "parameters": {"city": "rome", "unit": "c"}}',
               "mistral": '[TOOL_CALLS] [{"name": "weather", "arguments": {"city": "rome", '
                          '"unit": "c"}, "id": "' + MISTRAL.call_id("call_7") + '"}]'}[name]
    assert written in text and "sunny" in text
    if name == "mistral":  # the result names the call it answers, in the id the call has
        assert f'"call_id": "{MISTRAL.call_id("call_7")}"' in text
    else:  # (Mistral's template says the system message with the last user turn only)
        assert "Be brief." in text
    # and the model goes on from there: a result back, it may answer or call again
    done = local.generate([history], GenerateOptions(max_new_tokens=40,
                                                     **tool_options(TOOLS)))[0]
    assert all(valid(c) for c in done.calls)


@pytest.mark.parametrize("form", [HERMES, GENERIC, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_the_auto_grammar_takes_text_calls_or_both_and_never_a_broken_call(form):
    lm = family_lm("mistral")
    compiled = compiled_for(lm.model, lm.tokenizer, grammar=form.grammar([WEATHER, ALARM]))
    call = form.render([ToolCall("weather", {"city": "rome", "unit": "f"})])
    broken = form.render([ToolCall("weather", {"city": "oslo", "unit": "f"})])

    def accepts(text):
        matcher = xgr.GrammarMatcher(compiled)
        return matcher.accept_string(text) and matcher.accept_token(2)

    assert accepts("It is sunny.") and accepts(call) and accepts(f"Let me look. {call}")
    assert not accepts(broken) and not accepts(f"Let me look. {broken}")


@pytest.mark.parametrize("form", [HERMES, GENERIC, LLAMA3_JSON, MISTRAL], ids=lambda f: f.name)
def test_calls_parse_out_of_text_and_back(form):
    calls = [ToolCall("f", {"x": [1, 2]}), ToolCall("g", {})]
    shown = calls if form.parallel else calls[:1]
    written = form.render(shown)
    for text in (f"before {written} after", written.replace("[TOOL_CALLS]", "")):
        rest, parsed = form.parse(text)
        assert [(c.name, c.arguments) for c in parsed] == [(c.name, c.arguments)
                                                           for c in shown]
        assert rest.split() == (["before", "after"] if text.startswith("before") else [])
    # a block that is not a call stays text
    assert form.parse('{"name": 3} and [{"oops"}]') == ('{"name": 3} and [{"oops"}]', [])


@pytest.mark.parametrize("form, text, choice, expected", [
    # forced: the tool's name before the model wrote it, no arguments yet, no markup
    (GENERIC, '<tool_call>{"', "fetch", ("fetch", "")),
    (GENERIC, '<tool_call>{"name": "fet', "any", (None, "")),  # the name itself was cut
    (GENERIC, '<tool_call>{"name": "fetch", "arguments": {"url": "htt', "auto",
     ("fetch", '{"url": "htt')),
    (HERMES, '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
     '{"name": "b", "arguments": {"y": [1, ', "any", ("b", '{"y": [1, ')),  # the open one
    (LLAMA3_JSON, '{"name": "fetch", "parameters": {"q": "a b', "auto", ("fetch", '{"q": "a b')),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_w', "get_weather", ("get_weather", "")),
])
def test_a_cut_call_is_its_name_and_its_arguments_so_far(form, text, choice, expected):
    cut = form.cut(text, choice)
    assert (cut.name, cut.arguments) == expected
