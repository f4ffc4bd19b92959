"""``ChatLookahead``: a LangChain chat model that decodes speculatively, losslessly."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from operator import itemgetter
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from pydantic import BaseModel

from langchain_rag_spec._settings import LookaheadSettings, response_metadata, usage
from rag_spec import Chunk, Completion

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
        completion = lm.generate([_chat(messages)], self.options(stop, kwargs),
                                 kwargs.get("context", ()))[0]
        return self._result(completion)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        lm = self.local_lm()
        completions = await lm.agenerate([_chat(messages)], self.options(stop, kwargs),
                                         kwargs.get("context", ()))
        return self._result(completions[0])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[ChatGenerationChunk]:
        lm = self.local_lm()
        for chunk in lm.stream(_chat(messages), self.options(stop, kwargs),
                               kwargs.get("context", ())):
            yield self._chunk(chunk)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        lm = self.local_lm()
        async for chunk in lm.astream(_chat(messages), self.options(stop, kwargs),
                                      kwargs.get("context", ())):
            yield self._chunk(chunk)

    def with_structured_output(self, schema: dict[str, Any] | type, *,
                               method: str = "json_schema", include_raw: bool = False,
                               **kwargs: Any) -> Runnable:
        """Answers as ``schema`` (a Pydantic class, a TypedDict or a JSON schema dict), decoded
        under the schema's grammar: ``method="json_schema"`` constrains the output to the
        schema, ``"json_mode"`` to any JSON object (parsed as ``schema``). An answer cut at
        ``max_tokens`` before its JSON closed is an error (``parsing_error`` with
        ``include_raw=True``), never a parsed value."""
        if kwargs:
            msg = f"Unexpected arguments for with_structured_output: {sorted(kwargs)}."
            raise ValueError(msg)
        if method not in ("json_schema", "json_mode"):
            msg = (f"ChatLookahead decodes structured output under a grammar: method "
                   f"'json_schema' (the default) or 'json_mode', not {method!r}.")
            raise ValueError(msg)
        pydantic = isinstance(schema, type) and issubclass(schema, BaseModel)
        grammar = convert_to_json_schema(schema) if method == "json_schema" else \
            {"type": "object"}
        llm = self.bind(json_schema=json.dumps(grammar), ls_structured_output_format={
            "kwargs": {"method": method}, "schema": convert_to_json_schema(schema)})
        parse: Runnable = RunnableLambda(_closed) | (
            PydanticOutputParser(pydantic_object=schema) if pydantic else JsonOutputParser())
        if not include_raw:
            return llm | parse
        parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parse,
                                            parsing_error=lambda _: None)
        failed = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | parsed.with_fallbacks([failed],
                                                             exception_key="parsing_error")

    def _result(self, completion: Completion) -> ChatResult:
        message = AIMessage(content=completion.text, usage_metadata=usage(completion),
                            response_metadata=response_metadata(completion, self.model))
        return ChatResult(generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": completion.finish_reason})])

    def _chunk(self, chunk: Chunk) -> ChatGenerationChunk:
        if chunk.completion is None:
            return ChatGenerationChunk(message=AIMessageChunk(content=chunk.text))
        done = chunk.completion
        return ChatGenerationChunk(
            message=AIMessageChunk(content=chunk.text, chunk_position="last",
                                   usage_metadata=usage(done),
                                   response_metadata=response_metadata(done, self.model)),
            generation_info={"finish_reason": done.finish_reason})


def _closed(message: BaseMessage) -> BaseMessage:
    """``message`` if its JSON was finished; one cut at the token limit is no answer."""
    if message.response_metadata.get("finish_reason") == "length":
        msg = ("The structured answer was cut at max_tokens before its JSON closed; raise "
               "max_tokens.")
        raise OutputParserException(msg, llm_output=message.text)
    return message


def _chat(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as role/content dicts for the chat template."""
    return [{"role": m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type, "user"),
             "content": m.text} for m in messages]
