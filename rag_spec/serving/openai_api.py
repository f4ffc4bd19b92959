"""The OpenAI API's requests and responses, translated to and from ``LocalLM``'s: what
``rag-spec serve`` speaks, kept apart from the web framework so it reads (and is tested) on its
own.

Requests are pydantic models that refuse unknown fields and wrong types (an error that names
the field, never a guess); each becomes a prompt (chat messages or text) and
``GenerateOptions``. Responses are the API's JSON objects, with the speculation's statistics
in an extra ``rag_spec`` field that OpenAI clients ignore.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from rag_spec.errors import RagSpecError
from rag_spec.serving.local_lm import Completion, GenerateOptions, Prompt
from rag_spec.serving.tools import ToolCall, tool_options


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Request):
    """The decoding fields both generation routes take."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)  # one answer a request
    user: str | None = None  # accepted, unused (clients send it)

    def options(self, prompt_tokens: int, window: int | None, limit: int | None,
                **grammar: Any) -> GenerateOptions:
        """``GenerateOptions`` for a prompt of ``prompt_tokens``; ``limit`` is the request's
        own token cap, the rest of the context window where it gives none."""
        room = None if window is None else window - prompt_tokens
        if room is not None and room < 1:
            msg = (f"The prompt is {prompt_tokens} tokens, and the model's context window is "
                   f"{window}: shorten the prompt.")
            raise RagSpecError(msg)
        wanted = limit or room or 256
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return GenerateOptions(max_new_tokens=min(wanted, room) if room else wanted,
                               temperature=self.temperature, top_p=self.top_p,
                               stop=tuple(stops), seed=self.seed, **grammar)

    @property
    def usage_in_stream(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    def prompt(self) -> list[dict[str, Any]]:
        """The messages as ``LocalLM`` takes them: text parts joined, an assistant's
        ``tool_calls`` as ``ToolCall``s, a tool's result under its call's id."""
        return [_turn(m, i) for i, m in enumerate(self.messages)]

    def grammar(self) -> dict[str, Any]:
        """``GenerateOptions``' tool and JSON fields."""
        if self.response_format is not None:
            kind = self.response_format.get("type")
            if kind == "json_schema":
                schema = (self.response_format.get("json_schema") or {}).get("schema")
                if not isinstance(schema, Mapping):
                    msg = ("response_format json_schema needs a schema: "
                           '{"type": "json_schema", "json_schema": {"name": ..., "schema": '
                           "{...}}}.")
                    raise RagSpecError(msg)
                return {"json_schema": json.dumps(schema)}
            if kind == "json_object":
                return {"json_schema": json.dumps({"type": "object"})}
            if kind != "text":
                msg = (f"response_format type {kind!r} is not one of text, json_object, "
                       f"json_schema.")
                raise RagSpecError(msg)
        return tool_options(self.tools, self.tool_choice, parallel=bool(self.parallel_tool_calls))

    @property
    def limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt string or its token ids, completed as it is (the
    answer's token ids come back in the ``rag_spec`` field: what ``ServedModel`` continues)."""

    prompt: str | Annotated[list[NonNegativeInt], Field(min_length=1)]
    echo: bool = False

    @property
    def limit(self) -> int | None:
        return self.max_tokens


class EmbeddingRequest(_Request):
    """``POST /v1/embeddings``."""

    input: str | list[str]
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"  # base64: float32 bytes (the SDK's)
    user: str | None = None

    def texts(self) -> list[str]:
        texts = [self.input] if isinstance(self.input, str) else list(self.input)
        if not texts or not all(t.strip() for t in texts):
            msg = "input takes one or more non-empty strings."
            raise RagSpecError(msg)
        return texts


def _turn(message: Mapping[str, Any], at: int) -> dict[str, Any]:
    role = message.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        msg = (f"messages[{at}] has role {role!r}; use system, developer, user, assistant or "
               f"tool.")
        raise RagSpecError(msg)
    turn: dict[str, Any] = {"role": "system" if role == "developer" else role,
                            "content": _text(message.get("content"), at)}
    calls = message.get("tool_calls") or []
    if calls:
        try:
            turn["tool_calls"] = [ToolCall(c["function"]["name"],
                                           json.loads(c["function"].get("arguments") or "{}"),
                                           c.get("id") or "") for c in calls]
        except (KeyError, TypeError, ValueError) as err:
            msg = (f"messages[{at}].tool_calls: each is {{\"id\", \"type\": \"function\", "
                   f"\"function\": {{\"name\", \"arguments\": a JSON string}}}} ({err}).")
            raise RagSpecError(msg) from err
    if role == "tool":
        turn["tool_call_id"] = message.get("tool_call_id") or ""
        if message.get("name"):
            turn["name"] = message["name"]
    return turn


def _text(content: Any, at: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, Mapping) and p.get("type") == "text"
                                         for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    msg = f"messages[{at}].content takes text (a string, or parts of type text)."
    raise RagSpecError(msg)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def chat_message(completion: Completion) -> dict[str, Any]:
    """A finished answer as the API's assistant message."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.calls:
        message["content"] = completion.content or None
        message["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.name,
                                               "arguments": json.dumps(c.arguments)}}
                                 for c in completion.calls]
    return message


def chat_response(completion: Completion, model: str, request_id: str) -> dict[str, Any]:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": chat_message(completion), "logprobs": None,
                         "finish_reason": completion.api_finish_reason}],
            "usage": completion.usage(), "rag_spec": completion.speculation()}


def chat_chunk(request_id: str, model: str, delta: Mapping[str, Any],
               finish_reason: str | None = None, usage: Mapping[str, int] | None = None,
               extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One server-sent event's object of a streamed chat answer (``usage`` alone, with no
    choices, in the last one where the client asked)."""
    chunk: dict[str, Any] = {"id": request_id, "object": "chat.completion.chunk",
                             "created": int(time.time()), "model": model,
                             "choices": [] if usage is not None else [
                                 {"index": 0, "delta": dict(delta), "logprobs": None,
                                  "finish_reason": finish_reason}]}
    if usage is not None:
        chunk["usage"] = dict(usage)
    if extra:
        chunk["rag_spec"] = dict(extra)
    return chunk


def text_response(completion: Completion, model: str, request_id: str,
                  prefix: str = "") -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": prefix + completion.text, "logprobs": None,
                         "finish_reason": completion.api_finish_reason}],
            "usage": completion.usage(), "rag_spec": _with_ids(completion)}


def text_chunk(request_id: str, model: str, text: str, finish_reason: str | None = None,
               completion: Completion | None = None) -> dict[str, Any]:
    """A streamed completion's chunk; the last (``completion`` given) also carries the
    answer's token ids in the ``rag_spec`` field, as the whole response does."""
    chunk = {"id": request_id, "object": "text_completion", "created": int(time.time()),
             "model": model, "choices": [{"index": 0, "text": text, "logprobs": None,
                                          "finish_reason": finish_reason}]}
    if completion is not None:
        chunk["rag_spec"] = _with_ids(completion)
    return chunk


def _with_ids(completion: Completion) -> dict[str, Any]:
    """A completion's ``rag_spec`` field: its speculation's statistics and its token ids."""
    return {**completion.speculation(), "token_ids": completion.token_ids}


def embeddings_response(vectors: Any, model: str, tokens: int,
                        encoding: str = "float") -> dict[str, Any]:
    """``vectors`` (a float32 array, one row a text) as the API's list, each a list of floats
    or, with ``encoding="base64"``, its float32 bytes in base64."""
    import base64

    def encoded(row: Any) -> Any:
        return base64.b64encode(row.tobytes()).decode() if encoding == "base64" else \
            [float(x) for x in row]

    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": encoded(row)}
                     for i, row in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The API's error object: one sentence that names the fix."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def prompt_of(request: ChatRequest | CompletionRequest) -> Prompt:
    return request.prompt() if isinstance(request, ChatRequest) else request.prompt
