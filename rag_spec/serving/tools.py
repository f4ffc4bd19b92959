"""Tool calling on any local chat model: tools in the prompt, calls decoded under a grammar,
calls parsed back out. The framework adapters translate their tool objects to and from these.

The call format is the Hermes / Qwen one, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, one block per call (several make parallel calls). A chat template with a tools
section (Qwen 2.5/3, Llama 3.x, Mistral, ...) renders the tools itself; for one without (the
embedded SmolLM2) a system message describes them and the format. Either way the output is
decoded under a grammar built from the tools' JSON schemas (xgrammar): with ``tool_choice``
"auto" the model writes text and any ``<tool_call>`` it opens must be a valid call; "any"
(or "required") makes it call at least one tool, a tool's name that tool. So every call parses,
and its arguments follow their schema.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_spec.errors import RagSpecError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_CALLS = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)


@dataclass(frozen=True)
class Tool:
    """A tool the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=lambda: {"type": "object",
                                                                   "properties": {}})

    @classmethod
    def from_openai(cls, spec: Mapping[str, Any]) -> Tool:
        """From the OpenAI tool format frameworks convert to (``{"type": "function",
        "function": {"name", "description", "parameters"}}``), checked."""
        function = spec.get("function", spec) if isinstance(spec, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            msg = f"A tool needs a name and a JSON schema of its arguments (got {spec!r:.200})."
            raise RagSpecError(msg)
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        tool = cls(function["name"], str(function.get("description") or ""), parameters)
        tool.check()
        return tool

    def check(self) -> None:
        if not _NAME.match(self.name):
            msg = (f"Tool name {self.name!r} cannot be called: use letters, digits, _ . - "
                   f"(at most 64, not starting with a digit).")
            raise RagSpecError(msg)
        if not isinstance(self.parameters, Mapping) or \
                self.parameters.get("type", "object") != "object":
            msg = (f"Tool {self.name}: its arguments must be a JSON schema of an object "
                   f"(got {self.parameters!r:.200}).")
            raise RagSpecError(msg)

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: the tool's name, its arguments, and an id for the result."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def check_tools(tools: Sequence[Tool]) -> None:
    """One or more tools, each callable (of tools sharing a name, the first is the one
    offered, as frameworks bind a class and its schema under one name)."""
    for tool in tools:
        tool.check()
    if not tools:
        msg = "Give one or more tools."
        raise RagSpecError(msg)


def call_grammar(tools: Sequence[Tool], tool_choice: Any = "auto", *,
                 parallel: bool = False) -> str | None:
    """EBNF (xgrammar's) that the answer follows; None where tools are off (``"none"``).

    ``tool_choice``: "auto" (or None): text, and valid calls where it opens one; "any",
    "required" or True: a call and nothing else; a tool's name (or ``{"function": {"name":
    ...}}``): a call of that tool. ``parallel``: one or more calls, one per line, where a call
    is forced (small models otherwise repeat a call until the token limit)."""
    import xgrammar as xgr

    check_tools(tools)
    choice = _chosen(tools, tool_choice)
    if choice == "none":
        return None
    unique = _first_of_each_name(tools)
    tags = [_tag(t) for t in unique if choice in ("auto", "any") or t.name == choice]
    if choice == "auto":
        return str(xgr.Grammar.from_structural_tag(
            [xgr.StructuralTagItem(begin=OPEN + begin, schema=schema, end=end + CLOSE)
             for begin, schema, end in tags], [OPEN]))
    calls = xgr.Grammar.union(*[xgr.Grammar.concat(
        _literal(OPEN + begin), xgr.Grammar.from_json_schema(schema), _literal(end + CLOSE))
        for begin, schema, end in tags])
    if not parallel:
        return str(calls)
    # the calls' grammar, renamed, repeated: parallel calls one per line
    ebnf = str(calls).replace("root ::=", "rag_spec_call ::=", 1)
    return f'root ::= rag_spec_call ("\\n" rag_spec_call)*\n{ebnf}'


def tool_options(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None, *,
                 parallel: bool = False) -> dict[str, str | None]:
    """``GenerateOptions`` fields (``grammar``, ``tools``) for tools in the OpenAI format that
    frameworks convert theirs to: the grammar the answer follows and the tools the prompt
    offers (none of either where ``tools`` is empty or ``tool_choice`` is "none")."""
    if not tools:
        return {"grammar": None, "tools": None}
    offered = _first_of_each_name([Tool.from_openai(spec) for spec in tools])
    grammar = call_grammar(offered, tool_choice, parallel=parallel)
    return {"grammar": grammar,
            "tools": json.dumps([t.openai() for t in offered]) if grammar else None}


def _first_of_each_name(tools: Sequence[Tool]) -> list[Tool]:
    firsts: dict[str, Tool] = {}
    for tool in tools:
        firsts.setdefault(tool.name, tool)
    return list(firsts.values())


def _chosen(tools: Sequence[Tool], tool_choice: Any) -> str:
    if tool_choice in (None, "auto"):
        return "auto"
    if tool_choice in ("any", "required", True):
        return "any"
    if tool_choice == "none":
        return "none"
    name = tool_choice.get("function", tool_choice).get("name") \
        if isinstance(tool_choice, Mapping) else tool_choice
    if name not in {t.name for t in tools}:
        msg = (f"tool_choice {tool_choice!r} names no bound tool; use 'auto', 'any', 'none' or "
               f"one of {sorted(t.name for t in tools)}.")
        raise RagSpecError(msg)
    return str(name)


def _tag(tool: Tool) -> tuple[str, str, str]:
    """(text before the arguments, their schema, text after) of a call of ``tool``."""
    return f'{{"name": {json.dumps(tool.name)}, "arguments": ', json.dumps(
        dict(tool.parameters)), "}"


def _literal(text: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def tool_messages(messages: Sequence[Mapping[str, str]], tools: Sequence[Tool]
                  ) -> list[dict[str, str]]:
    """``messages`` with a system message that describes ``tools`` and the call format, for
    chat templates without a tools section."""
    lines = "\n".join(json.dumps(t.openai()["function"]) for t in tools)
    system = (f"You can call tools. To call one, write {OPEN}{{\"name\": <tool name>, "
              f"\"arguments\": <its arguments as JSON>}}{CLOSE}; write several blocks to call "
              f"several. Their results come back as {RESULT_OPEN}...{RESULT_CLOSE}: then "
              f"answer with them. Tools:\n{lines}")
    # results as the user's turn: a template without a tools section knows no tool role
    rest = [{"role": "user", "content": _result(m)} if m.get("role") == "tool" else dict(m)
            for m in messages]
    if rest and rest[0].get("role") == "system":
        rest[0]["content"] = f"{rest[0]['content']}\n\n{system}"
        return rest
    return [{"role": "system", "content": system}, *rest]


def _result(message: Mapping[str, str]) -> str:
    """A tool's result as the user's turn says it: the tool's name where the turn has one."""
    name = f"{message['name']}: " if message.get("name") else ""
    return f"{RESULT_OPEN}{name}{message['content']}{RESULT_CLOSE}"


def template_has_tools(tokenizer: Any) -> bool:
    """Whether the chat template renders tools itself (it changes when given one)."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return False
    probe = [{"role": "user", "content": "x"}]
    tool = Tool("rag_spec_probe", "probe").openai()
    try:
        plain = tokenizer.apply_chat_template(probe, tokenize=False)
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False)
    except Exception:  # a template that fails on tools has no tools section
        return False
    return bool(with_tools != plain and "rag_spec_probe" in with_tools)


def render_call(call: ToolCall) -> str:
    """A call as the model writes it (for the conversation's history)."""
    return f"{OPEN}{json.dumps({'name': call.name, 'arguments': call.arguments})}{CLOSE}"


def parse_calls(text: str) -> tuple[str, list[ToolCall]]:
    """(the text outside calls, the calls) of an answer; a block that does not parse as a
    call stays in the text (the grammar makes that impossible for answers decoded here)."""
    calls: list[ToolCall] = []
    kept: list[str] = []
    last = 0
    for match in _CALLS.finditer(text):
        try:
            body = json.loads(match.group(1))
            name, arguments = body["name"], body.get("arguments", body.get("parameters", {}))
        except (ValueError, KeyError, TypeError):
            continue
        if not isinstance(name, str) or not isinstance(arguments, dict):
            continue
        kept.append(text[last:match.start()])
        last = match.end()
        calls.append(ToolCall(name, arguments))
    kept.append(text[last:])
    return "".join(kept).strip(), calls
