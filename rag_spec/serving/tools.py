"""Tool calling on any local chat model: tools in the prompt, calls decoded under a grammar in
the model family's own call format, calls parsed back out. The framework adapters translate
their tool objects and messages to and from these.

A chat template with a tools section (Qwen 2.5/3, Llama 3.x, Mistral, ...) renders the tools,
the assistant's calls and the tools' results itself, and the model writes calls the way it
was trained to (``call_format`` reads which from the template: Hermes / Qwen's
``<tool_call>`` blocks, Llama 3.x's bare JSON with ``"parameters"``, Mistral's
``[TOOL_CALLS]`` array). A template without one (the embedded SmolLM2) gets a system message
that describes the tools and the generic format (Hermes' blocks, one line each), and results
as the user's turn. Either way
the answer is decoded under a grammar built from the tools' JSON schemas with xgrammar's
structural tags: with ``tool_choice`` "auto" the model writes text and any call it opens
must be valid; "any" (or "required") makes it call, a tool's name call that tool. So every
call parses, and its arguments follow their schema.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rag_spec.errors import RagSpecError

RESULT_OPEN, RESULT_CLOSE = "<tool_response>", "</tool_response>"
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")
_JSON = json.JSONDecoder(strict=False)  # control characters in strings: xgrammar allows some


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


@dataclass(frozen=True)
class CutCall:
    """A tool call that the token limit cut before it closed: the tool's name where the
    answer wrote it whole (or the choice forced it), and its arguments' JSON as far as the
    answer got, without the call format's markup."""

    name: str | None
    arguments: str


@dataclass(frozen=True)
class CallFormat:
    """How one model family writes tool calls: ``open`` + calls joined by ``sep`` +
    ``close``, each call ``call_open`` + ``{"name": ..., <key>: {arguments}}`` +
    ``call_close``; ``trigger`` opens calls amid free text. ``reads`` finds the start of a
    block in decoded text (a special-token marker such as Mistral's ``[TOOL_CALLS]`` is
    dropped by decoding, so it is optional there)."""

    name: str
    trigger: str
    open: str
    call_open: str
    key: str
    call_close: str
    sep: str
    close: str
    parallel: bool  # the family's template holds several calls in one answer
    reads: str  # regex: a block's start, up to its first call's object
    id_length: int | None = None  # the template's required call-id length (Mistral's: 9)

    def grammar(self, tools: Sequence[Tool], tool_choice: Any = "auto", *,
                parallel: bool = False) -> str | None:
        """EBNF (xgrammar's) that an answer follows; None where tools are off ("none").

        ``tool_choice``: "auto" (or None): text, and valid calls where it opens one; "any",
        "required" or True: a call and nothing else; a tool's name (or ``{"function":
        {"name": ...}}``): a call of that tool. ``parallel``: a forced answer may hold
        several calls, where the family's format allows (small models otherwise repeat a
        call until the token limit)."""
        import xgrammar as xgr
        from xgrammar import structural_tag as st

        check_tools(tools)
        choice = _chosen(tools, tool_choice)
        if choice == "none":
            return None
        tags = [st.TagFormat(begin=f'{self.call_open}{{"name": {json.dumps(t.name)}, '
                             f'"{self.key}": ',
                             # as little free whitespace as structural tags allow (one
                             # character a place): a small model spends tokens on it
                             content=st.JSONSchemaFormat(json_schema=dict(t.parameters),
                                                         max_whitespace_cnt=1),
                             end="}" + self.call_close)
                for t in _first_of_each_name(tools) if choice in ("auto", "any")
                or t.name == choice]
        many = self.parallel if choice == "auto" else parallel and self.parallel
        calls = st.TagsWithSeparatorFormat(tags=tags, separator=self.sep, at_least_one=True,
                                           stop_after_first=not many)
        if choice == "auto":  # free text, where the trigger opens calls
            block: Any = st.TriggeredTagsFormat(
                triggers=[self.trigger], stop_after_first=not self.parallel,
                tags=[st.TagFormat(begin=self.open, content=calls, end=self.close)]
                if self.open else tags)
        else:
            block = st.SequenceFormat(elements=[
                *([st.ConstStringFormat(value=self.open)] if self.open else []), calls,
                *([st.ConstStringFormat(value=self.close)] if self.close else [])])
        return str(xgr.Grammar.from_structural_tag(st.StructuralTag(format=block)))

    def render(self, calls: Sequence[ToolCall]) -> str:
        """Calls as the family writes them (a conversation's history, for a template that
        does not render them itself)."""
        written = [f"{self.call_open}{json.dumps({'name': c.name, self.key: c.arguments})}"
                   f"{self.call_close}" for c in calls]
        return f"{self.open}{self.sep.join(written)}{self.close}" if written else ""

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside calls, the calls) of an answer; a block that does not parse as
        calls stays in the text (the grammar makes that impossible for answers decoded
        here)."""
        calls: list[ToolCall] = []
        kept: list[str] = []
        last = search = 0
        while (start := re.compile(self.reads).search(text, search)) is not None:
            found, end = self._block(text, start.end())
            if found:
                kept.append(text[last:start.start()])
                calls += found
                last = search = end
            else:
                search = start.start() + 1
        kept.append(text[last:])
        return "".join(kept).strip(), calls

    def unfinished(self, text: str, forced: bool) -> int | None:
        """Where the call that an answer cut at the token limit left open starts (None: no
        call was open): the first block that does not parse, or a trigger past the last one
        that does; where calls were ``forced``, whatever follows the last whole call."""
        search = 0
        while (start := re.compile(self.reads).search(text, search)) is not None:
            found, end = self._block(text, start.end())
            if not found:
                return start.start()
            search = end
        at = text.rfind(self.trigger, search)
        if at < 0 and forced and text[search:].strip():
            at = search
        return at if at >= 0 else None

    def cut(self, text: str, tool_choice: str = "auto") -> CutCall:
        """The call that ``text``, an answer's end from where ``unfinished`` says a call was
        left open, holds: its name (a forced ``tool_choice``'s where the answer had not
        written it yet) and its arguments so far."""
        starts = list(_CALL_START.finditer(text))
        found = _CALL_HEAD.match(text, starts[-1].start()) if starts else None
        name = found["name"] if found is not None and found["closed"] else None
        if tool_choice not in ("auto", "any"):
            name = tool_choice
        arguments = ""
        if found is not None and found["key"] in (self.key, "arguments", "parameters"):
            arguments = text[found.end():]
        return CutCall(name, arguments)

    def call_id(self, call_id: str) -> str:
        """``call_id`` as the template accepts it (Mistral's: 9 letters or digits, stably
        derived from any other id, so a call and its result keep matching)."""
        if self.id_length is None or (len(call_id) == self.id_length and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:self.id_length]

    def _new_call(self, name: str, arguments: dict[str, Any]) -> ToolCall:
        return ToolCall(name, arguments, id=self.call_id(f"call_{uuid.uuid4().hex[:24]}"))

    def _block(self, text: str, at: int) -> tuple[list[ToolCall], int]:
        """The calls of the block whose first call's object starts at ``at``, and where the
        block ends; ([], at) where it is not a block of calls."""
        calls: list[ToolCall] = []
        while True:
            try:
                body, at = _JSON.raw_decode(text, at)
                name = body["name"]
                arguments = body.get(self.key, body.get("arguments", body.get("parameters")))
            except (ValueError, KeyError, TypeError, AttributeError):
                return [], at
            if not isinstance(name, str) or not isinstance(arguments, dict):
                return [], at
            calls.append(self._new_call(name, arguments))
            at = _skip(text, at, self.call_close)
            if at < 0:
                return [], at
            following = _skip(text, at, self.sep + self.call_open)
            if following >= 0 and text.startswith("{", following):
                at = following
                continue
            end = _skip(text, at, self.close)
            return (calls, end) if end >= 0 else ([], at)


_CALL_START = re.compile(r'\{\s*"name"\s*:')
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"(?P<name>(?:[^"\\]|\\.)*)(?P<closed>"?)'
                        r'(?:\s*,\s*"(?P<key>\w+)"\s*:\s*)?')


def _skip(text: str, at: int, literal: str) -> int:
    """Where ``literal`` ends, read at ``at`` with any whitespace where it has some (and
    before it); -1 where the text says something else."""
    pattern = r"\s*" + "".join(re.escape(part) + r"\s*" for part in literal.split())
    found = re.compile(pattern).match(text, at)
    return found.end() if found else -1


HERMES = CallFormat("hermes", trigger="<tool_call>", open="", call_open="<tool_call>\n",
                    key="arguments", call_close="\n</tool_call>", sep="\n", close="",
                    parallel=True, reads=r"<tool_call>\s*(?=\{)")
GENERIC = CallFormat("generic", trigger="<tool_call>", open="", call_open="<tool_call>",
                     key="arguments", call_close="</tool_call>", sep="\n", close="",
                     parallel=True, reads=r"<tool_call>\s*(?=\{)")
LLAMA3_JSON = CallFormat("llama3_json", trigger='{"name": ', open="", call_open="",
                         key="parameters", call_close="", sep="; ", close="", parallel=False,
                         reads=r'(?=\{\s*"name"\s*:)')
MISTRAL = CallFormat("mistral", trigger="[TOOL_CALLS]", open="[TOOL_CALLS] [", call_open="",
                     key="arguments", call_close="", sep=", ", close="]", parallel=True,
                     reads=r'(?:\[TOOL_CALLS\])?\s*\[\s*(?=\{\s*"name")', id_length=9)


def call_format(tokenizer: Any) -> CallFormat:
    """The call format the tokenizer's chat template speaks: Mistral's where it writes
    ``[TOOL_CALLS]``, Hermes / Qwen's where it writes ``<tool_call>``, Llama 3.x's where it
    asks for ``"parameters"``, Hermes' for another template with a tools section. Without
    one, the generic format a system message teaches: Hermes' blocks on one line each."""
    template = getattr(tokenizer, "chat_template", None) or ""
    template = template if isinstance(template, str) else json.dumps(template)
    if not template_has_tools(tokenizer):
        return GENERIC
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if '"parameters"' in template and "<tool_call>" not in template:
        return LLAMA3_JSON
    return HERMES


def check_tools(tools: Sequence[Tool]) -> None:
    """One or more tools, each callable (of tools sharing a name, the first is the one
    offered, as frameworks bind a class and its schema under one name)."""
    for tool in tools:
        tool.check()
    if not tools:
        msg = "Give one or more tools."
        raise RagSpecError(msg)


def call_grammar(tools: Sequence[Tool], tool_choice: Any = "auto", *, parallel: bool = False,
                 form: CallFormat = HERMES) -> str | None:
    """``form.grammar``: the EBNF an answer with ``tools`` follows (checks the tools and
    the choice; an unusable schema fails here)."""
    return form.grammar(tools, tool_choice, parallel=parallel)


@functools.lru_cache(maxsize=64)
def options_grammar(form: CallFormat, tools: str, tool_choice: str,
                    parallel: bool) -> str | None:
    """The grammar of ``GenerateOptions``' tool fields (cached: agents repeat them)."""
    return form.grammar([Tool.from_openai(spec) for spec in json.loads(tools)], tool_choice,
                          parallel=parallel)


def tool_options(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None, *,
                 parallel: bool = False) -> dict[str, Any]:
    """``GenerateOptions`` fields for tools in the OpenAI format that frameworks convert
    theirs to, checked: the tools offered (as JSON), the choice ("auto", "any" or a tool's
    name) and whether a forced answer may hold several calls. The model's ``LocalLM`` builds
    the grammar in its family's format. No tools where ``tools`` is empty or the choice is
    "none"."""
    off = {"tools": None, "tool_choice": "auto", "parallel_tool_calls": False}
    if not tools:
        return off
    offered = _first_of_each_name([Tool.from_openai(spec) for spec in tools])
    check_tools(offered)
    choice = _chosen(offered, tool_choice)
    if choice == "none":
        return off
    return {"tools": json.dumps([t.openai() for t in offered]), "tool_choice": choice,
            "parallel_tool_calls": bool(parallel)}


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


def chat_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Tool], *,
                  form: CallFormat, native: bool) -> list[dict[str, Any]]:
    """Messages for the chat template. An assistant turn's ``tool_calls`` (``ToolCall``s)
    and a ``tool`` turn's result (``tool_call_id``, optional ``name``) go to a template with a
    tools section (``native``) as the fields it renders, ids as it accepts them; for one
    without, calls are written into the text in ``form``, results become the user's turn,
    and a system message describes ``tools`` (where offered) and the format."""
    names = {c.id: c.name for m in messages for c in m.get("tool_calls") or ()}
    chat: list[dict[str, Any]] = []
    for message in messages:
        turn = {"role": message["role"], "content": message.get("content") or ""}
        calls = list(message.get("tool_calls") or ())
        if message["role"] == "tool":
            call_id = message.get("tool_call_id") or ""
            name = message.get("name") or names.get(call_id)
            if not native:
                turn = {"role": "user", "content": _result(name, turn["content"])}
            else:
                turn.update({"tool_call_id": form.call_id(call_id)} if call_id else {})
                turn.update({"name": name} if name else {})
        elif calls and native:
            turn["tool_calls"] = [{"id": form.call_id(c.id), "type": "function",
                                   "function": {"name": c.name, "arguments": c.arguments}}
                                  for c in calls]
        elif calls:
            turn["content"] = f"{turn['content']}\n{form.render(calls)}".strip()
        chat.append(turn)
    if native or not tools:
        return chat
    return _with_system(chat, _described(tools, form))


def _described(tools: Sequence[Tool], form: CallFormat) -> str:
    """A system message's words on ``tools`` and the call format, for chat templates without
    a tools section."""
    lines = "\n".join(json.dumps(t.openai()["function"]) for t in tools)
    call = f'{form.call_open}{{"name": <tool name>, "{form.key}": <its arguments as JSON>}}' \
           f"{form.call_close}"
    return (f"You can call tools. To call one, write {form.open}{call}{form.close}; write "
            f"several blocks to call several. Their results come back as "
            f"{RESULT_OPEN}...{RESULT_CLOSE}: then answer with them. Tools:\n{lines}")


def _with_system(chat: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    if chat and chat[0]["role"] == "system":
        return [{**chat[0], "content": f"{chat[0]['content']}\n\n{system}"}, *chat[1:]]
    return [{"role": "system", "content": system}, *chat]


def _result(name: str | None, content: str) -> str:
    """A tool's result as the user's turn says it: the tool's name where known."""
    return f"{RESULT_OPEN}{f'{name}: ' if name else ''}{content}{RESULT_CLOSE}"


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
