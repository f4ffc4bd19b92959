"""``LookaheadLLM``: a LangChain text-completion LLM that decodes speculatively, losslessly."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseLLM
from langchain_core.outputs import Generation, GenerationChunk, LLMResult

from langchain_rag_spec._settings import LookaheadSettings, response_metadata, usage
from rag_spec import Chunk, Completion


class LookaheadLLM(LookaheadSettings, BaseLLM):
    """A local Hugging Face model completing raw text; replaces ``HuggingFacePipeline``.

    Returns only the new text (never the prompt), honours ``stop``, decodes a ``batch`` as
    one batch, streams each accepted chunk, and never blocks an event loop.

    Examples:
        >>> LookaheadLLM(max_tokens=32).invoke("def fibonacci(n):")       # doctest: +SKIP
    """

    @property
    def _llm_type(self) -> str:
        return "rag-spec-lookahead"

    def _generate(self, prompts: list[str], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None,
                  **kwargs: Any) -> LLMResult:
        lm = self.local_lm()
        return self._result(lm.generate(prompts, self.options(stop, kwargs),
                                        kwargs.get("context", ())))

    async def _agenerate(self, prompts: list[str], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> LLMResult:
        lm = self.local_lm()
        return self._result(await lm.agenerate(prompts, self.options(stop, kwargs),
                                               kwargs.get("context", ())))

    def _stream(self, prompt: str, stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None,
                **kwargs: Any) -> Iterator[GenerationChunk]:
        lm = self.local_lm()
        for piece in lm.stream(prompt, self.options(stop, kwargs), kwargs.get("context", ())):
            chunk = self._chunk(piece)
            if run_manager:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _astream(self, prompt: str, stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[GenerationChunk]:
        lm = self.local_lm()
        async for piece in lm.astream(prompt, self.options(stop, kwargs),
                                      kwargs.get("context", ())):
            chunk = self._chunk(piece)
            if run_manager:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _result(self, completions: list[Completion]) -> LLMResult:
        return LLMResult(
            generations=[[Generation(text=c.text, generation_info=self._info(c))]
                         for c in completions],
            llm_output={"model_name": self.model})

    def _info(self, completion: Completion) -> dict[str, Any]:
        return {**response_metadata(completion, self.model), "usage": usage(completion)}

    def _chunk(self, chunk: Chunk) -> GenerationChunk:
        done = chunk.completion
        return GenerationChunk(text=chunk.text,
                               generation_info=None if done is None else self._info(done))
