"""``ChatLookahead``: a LangChain chat model that decodes speculatively, losslessly."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from operator import itemgetter
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from pydantic import BaseModel
from pydantic.v1 import BaseModel as BaseModelV1

from langchain_rag_spec._settings import LookaheadSettings, response_metadata, usage
from rag_spec import Chunk, Completion, Tool, ToolCall, call_grammar

_ROLES = {"system": "system", "human": "user", "ai": "assistant", "tool": "tool"}


class ChatLookahead(LookaheadSettings, BaseChatModel):
    """A local Hugging Face chat model with lookahead decoding; replaces ``ChatHuggingFace``.

    The model's chat template is applied; greedy output equals ``transformers`` ``generate``
    token for token. ``batch`` and concurrent calls decode as one batch; async methods never
    block the event loop; ``stop`` strings cut the answer exactly.

    Examples:
        >>> llm = ChatLookahead(max_tokens=64)                            # doctest: +SKIP
        >>> llm.invoke("What does os.path.join do?").content              # doctest: +SKIP
    """

    @property
    def _llm_type(self) -> str:
        return "rag-spec-chat-lookahead"

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> ChatResult:
        lm = self.local_lm()
        options = self.options(stop, kwargs)
        completion = lm.generate([chat_turns(messages)], options, kwargs.get("context", ()))[0]
        return self._result(completion)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        lm = self.local_lm()
        options = self.options(stop, kwargs)
        completions = await lm.agenerate([chat_turns(messages)], options, kwargs.get("context", ()))
        return self._result(completions[0])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        lm = self.local_lm()
        options = self.options(stop, kwargs)
        chunks = lm.stream(chat_turns(messages), options, kwargs.get("context", ()))
        yield from _with_calls(chunks, self._chunk) if options.tools else map(self._chunk, chunks)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        lm = self.local_lm()
        options = self.options(stop, kwargs)
        held: list[Chunk] = []  # with tools, text and calls come once the answer is whole
        async for chunk in lm.astream(chat_turns(messages), options, kwargs.get("context", ())):
            if options.tools:
                held.append(chunk)
            else:
                yield self._chunk(chunk)
        for whole in _with_calls(held, self._chunk) if held else ():
            yield whole

    def with_structured_output(self, schema: dict[str, Any] | type, *,
                               method: str = "json_schema", include_raw: bool = False,
                               strict: bool | None = None, **kwargs: Any) -> Runnable:
        """Answers as ``schema`` (a Pydantic class, v2 or v1, a TypedDict or a JSON schema
        dict), decoded under a grammar: ``method="json_schema"`` constrains the output to the
        schema, ``"function_calling"`` to a call of a tool of that schema (``bind_tools``),
        ``"json_mode"`` to any JSON object (parsed as ``schema``). An answer cut at
        ``max_tokens`` before its JSON closed is an error (``parsing_error`` with
        ``include_raw=True``), never a parsed value. Decoding under a grammar is always
        strict: ``strict`` is accepted and changes nothing."""
        if kwargs:
            msg = f"Unexpected arguments for with_structured_output: {sorted(kwargs)}."
            raise ValueError(msg)
        if method not in ("json_schema", "function_calling", "json_mode"):
            msg = (f"method must be 'json_schema' (the default), 'function_calling' or "
                   f"'json_mode', not {method!r}.")
            raise ValueError(msg)
        pydantic = isinstance(schema, type) and issubclass(schema, (BaseModel, BaseModelV1))
        traced = {"ls_structured_output_format": {
            "kwargs": {"method": method}, "schema": convert_to_openai_tool(schema)}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **traced)
            parser: Runnable = PydanticToolsParser(tools=[schema], first_tool_only=True) \
                if pydantic else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
        else:
            grammar = convert_to_json_schema(schema) if method == "json_schema" else \
                {"type": "object"}
            llm = self.bind(json_schema=json.dumps(grammar), **traced)
            parser = PydanticOutputParser(pydantic_object=schema) if pydantic \
                else JsonOutputParser()
        parse = RunnableLambda(_closed) | parser
        if not include_raw:
            return llm | parse
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parse,
                                            parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed],
                                                             exception_key="parsing_error")

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   parallel_tool_calls: bool = False, **kwargs: Any) -> Runnable:
        """Offer ``tools`` (LangChain tools, Pydantic classes, functions or OpenAI tool dicts):
        through the chat template's tools section where it has one, in the model family's
        call format, else a system message in the ``<tool_call>`` format
        (``rag_spec.serving.tools``). Calls are decoded under a grammar of the tools'
        schemas, so each parses into ``AIMessage.tool_calls``;
        ``tool_choice``: "auto" (default), "any" / "required" (a call is made), a tool's
        name (that tool), or "none"; ``parallel_tool_calls``: a forced answer may hold several
        calls (one per line)."""
        formatted = [convert_to_openai_tool(t) for t in tools]
        call_grammar([Tool.from_openai(spec) for spec in formatted], tool_choice)  # checked now
        return self.bind(tools=formatted, tool_choice=tool_choice,
                         parallel_tool_calls=parallel_tool_calls, **kwargs)

    def _result(self, completion: Completion) -> ChatResult:
        message = AIMessage(content=completion.content, usage_metadata=usage(completion),
                            tool_calls=_calls(completion),
                            invalid_tool_calls=_cut(completion),
                            response_metadata=response_metadata(completion, self.model))
        return ChatResult(generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": completion.api_finish_reason})])

    def _chunk(self, chunk: Chunk) -> ChatGenerationChunk:
        if chunk.completion is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        done = chunk.completion
        return ChatGenerationChunk(
            message=AIMessageChunk(content=chunk.text, chunk_position="last",
                                   usage_metadata=usage(done),
                                   response_metadata=response_metadata(done, self.model)),
            generation_info={"finish_reason": done.api_finish_reason})


def _cut(completion: Completion) -> list[dict[str, Any]]:
    """A tool call cut at the token limit, as an invalid call (an agent loop must not take
    its text for the final answer): the tool's name, its arguments so far."""
    cut = completion.cut_call
    if cut is None:
        return []
    return [{"name": cut.name, "args": cut.arguments, "id": None,
             "error": "The tool call was cut at max_tokens before it closed; raise max_tokens.",
             "type": "invalid_tool_call"}]


def _closed(message: BaseMessage) -> BaseMessage:
    """``message`` if its JSON was finished; one cut at the token limit is no answer."""
    if message.response_metadata.get("finish_reason") == "length":
        msg = ("The structured answer was cut at max_tokens before its JSON closed; raise "
               "max_tokens.")
        raise OutputParserException(msg, llm_output=message.text)
    return message


def _with_calls(chunks: Any, chunk: Any) -> Iterator[ChatGenerationChunk]:
    """A streamed answer with tools: its text outside calls, then its calls, in the last
    chunk (a call is yielded only once it parses), as ``invoke`` gives them: a call cut at
    the token limit is the same ``invalid_tool_calls`` entry. It stays out of the chunk's
    ``tool_call_chunks``, from which LangChain's chunk addition would parse its partial
    arguments into a call to run."""
    pieces = list(chunks)
    last = chunk(pieces[-1])
    done = pieces[-1].completion
    calls = _calls(done)
    message = AIMessageChunk(
        content=done.content, chunk_position="last", usage_metadata=last.message.usage_metadata,
        response_metadata=last.message.response_metadata, tool_calls=calls,
        invalid_tool_calls=_cut(done))
    message.tool_call_chunks = [{"name": c["name"], "args": json.dumps(c["args"]),
                                 "id": c["id"], "index": i, "type": "tool_call_chunk"}
                                for i, c in enumerate(calls)]
    yield ChatGenerationChunk(message=message, generation_info=last.generation_info)


def _calls(completion: Completion) -> list[dict[str, Any]]:
    return [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"}
            for c in completion.calls]


def chat_turns(messages: list[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages as rag_spec's chat turns: an AI message's tool calls as
    ``ToolCall``s, a tool's result with the id of the call it answers (and its name where
    the message has one)."""
    chat = []
    for m in messages:
        turn: dict[str, Any] = {
            "role": m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type, "user"),
            "content": m.text}
        if isinstance(m, AIMessage) and m.tool_calls:
            turn["tool_calls"] = [ToolCall(c["name"], c["args"], c.get("id") or "")
                                  for c in m.tool_calls]
        if isinstance(m, ToolMessage):
            turn.update({"tool_call_id": m.tool_call_id, **({"name": m.name} if m.name else {})})
        chat.append(turn)
    return chat
