"""``ChatLookahead``: a LangChain chat model that decodes speculatively, losslessly."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

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


def _chat(messages: list[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as role/content dicts for the chat template."""
    return [{"role": m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type, "user"),
             "content": m.text} for m in messages]
