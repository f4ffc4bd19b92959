"""``LookaheadLLM``: a LlamaIndex LLM that decodes speculatively, losslessly."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, model_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from rag_spec import (
    DEFAULT_MODEL,
    CallFormat,
    Completion,
    GenerateOptions,
    LocalLM,
    LookaheadConfig,
    Prompt,
    RagSpecError,
    ToolCall,
    tool_options,
)


class LookaheadLLM(FunctionCallingLLM):
    """A local Hugging Face model with lookahead decoding; replaces ``HuggingFaceLLM``.

    ``chat`` applies the model's chat template; ``complete`` takes the prompt as text.
    Greedy output equals ``transformers`` ``generate``; async methods never block the loop;
    ``additional_kwargs`` of every response carry token counts and speculation stats.

    A function-calling LLM: ``chat_with_tools`` / ``predict_and_call`` / ``FunctionAgent`` offer
    the tools through the chat template (or a system message where it has no tools section)
    and decode calls under a grammar of their schemas (``rag_spec.serving.tools``), so every
    call parses; ``structured_predict`` goes through such a call.

    Examples:
        >>> from llama_index.core import Settings                         # doctest: +SKIP
        >>> Settings.llm = LookaheadLLM(max_new_tokens=128)               # doctest: +SKIP
    """

    model: str = Field(default=DEFAULT_MODEL,
                       description="Embedded model name or a local Hugging Face folder.")
    model_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="rag_spec.load_model arguments: device, dtype.")
    lookahead: dict[str, Any] = Field(
        default_factory=dict, description="rag_spec.LookaheadConfig fields.")
    draft_model: Any = Field(
        default=None, description="A draft model of the same vocabulary (embedded name, folder "
        "or model object) or 'early-exit:L' (the model's first L layers), merged with the "
        "trie's drafts; None: the default, the model's draft head + the trie where it has one "
        "(the embedded model does), else the trie.")
    max_new_tokens: int = Field(default=256, description="Most tokens per answer.")
    temperature: float = Field(default=0.0, description="0 decodes greedily.")
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: list[str] = Field(default_factory=list, description="Strings that end an answer.")
    seed: int | None = None
    context_window: int | None = Field(
        default=None, description="Tokens the model takes; None reads it from the model.")

    @model_validator(mode="after")
    def _check_options(self) -> LookaheadLLM:
        """Refused when built, in the decoder's words, not at the first call."""
        self._options({})
        return self

    @classmethod
    def class_name(cls) -> str:
        return "RagSpecLookaheadLLM"

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self._lm().context_window
        if window is None:
            msg = (f"The context window of {self.model} is not in its config; pass it: "
                   "LookaheadLLM(context_window=...).")
            raise RagSpecError(msg)
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens,
                           is_chat_model=True, is_function_calling_model=True,
                           model_name=self.model)

    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None
                                 = None, chat_history: list[ChatMessage] | None = None,
                                 verbose: bool = False, allow_parallel_tool_calls: bool = False,
                                 tool_required: bool = False, **kwargs: Any) -> dict[str, Any]:
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(user_msg if isinstance(user_msg, ChatMessage)
                            else ChatMessage(role=MessageRole.USER, content=user_msg))
        # structured programs (structured_predict, as_structured_llm) pass tool_choice=None
        # with tool_required=True: the call is forced
        choice = kwargs.pop("tool_choice", None) or ("required" if tool_required else "auto")
        return {"messages": messages, "tools": [t.metadata.to_openai_tool() for t in tools],
                "tool_choice": choice, "parallel_tool_calls": allow_parallel_tool_calls,
                **kwargs}

    def get_tool_calls_from_response(self, response: ChatResponse,
                                     error_on_no_tool_call: bool = True,
                                     **kwargs: Any) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls", [])
        if not calls and error_on_no_tool_call:
            cut = response.message.additional_kwargs.get("cut_tool_call")
            msg = (f"The tool call to {cut['name']} was cut at max_new_tokens before it closed "
                   f"(arguments so far: {cut['arguments']!r:.200}); raise max_new_tokens."
                   if cut else
                   f"Expected a tool call, got text: {response.message.content!r:.200}")
            raise ValueError(msg)
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"])
                for c in calls]

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat_response(self._generate(_chat(messages), kwargs))

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return _completion_response(self._generate(self._text(prompt, formatted), kwargs))

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        chunks = self._lm().stream(_chat(messages), self._options(kwargs))
        form = self._lm().call_format if kwargs.get("tools") else None
        return (_chat_response(c, text, c.text, form) for c, text in _accumulate(chunks))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponseGen:
        chunks = self._lm().stream(self._text(prompt, formatted), self._options(kwargs))
        return (_completion_response(c, text, c.text) for c, text in _accumulate(chunks))

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return _chat_response(await self._agenerate(_chat(messages), kwargs))

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False,
                        **kwargs: Any) -> CompletionResponse:
        return _completion_response(await self._agenerate(self._text(prompt, formatted), kwargs))

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage],
                           **kwargs: Any) -> ChatResponseAsyncGen:
        chunks = self._lm().astream(_chat(messages), self._options(kwargs))
        form = self._lm().call_format if kwargs.get("tools") else None
        return (_chat_response(c, text, c.text, form) async for c, text in _aaccumulate(chunks))

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False,
                               **kwargs: Any) -> CompletionResponseAsyncGen:
        chunks = self._lm().astream(self._text(prompt, formatted), self._options(kwargs))

        return (_completion_response(c, text, c.text) async for c, text in _aaccumulate(chunks))

    def _lm(self) -> LocalLM:
        return LocalLM.shared(self.model, config=LookaheadConfig(**self.lookahead),
                              draft=self.draft_model, **self.model_kwargs)

    def _text(self, prompt: str, formatted: bool) -> str:
        return prompt if formatted else self.completion_to_prompt(prompt)

    def _options(self, overrides: dict[str, Any]) -> GenerateOptions:
        names = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")
        values = {name: overrides.get(name, getattr(self, name)) for name in names}
        tools = tool_options(overrides.get("tools"), overrides.get("tool_choice"),
                             parallel=bool(overrides.get("parallel_tool_calls")))
        return GenerateOptions(stop=tuple(overrides.get("stop", self.stop)), **tools, **values)

    def _generate(self, prompt: Prompt, overrides: dict[str, Any]) -> Completion:
        return self._lm().generate([prompt], self._options(overrides))[0]

    async def _agenerate(self, prompt: Prompt, overrides: dict[str, Any]) -> Completion:
        return (await self._lm().agenerate([prompt], self._options(overrides)))[0]


def _chat(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex messages as rag_spec's chat turns: an assistant's tool calls as
    ``ToolCall``s, a tool's result with the id of the call it answers."""
    chat = []
    for m in messages:
        turn: dict[str, Any] = {"role": m.role.value, "content": m.content or ""}
        calls = [ToolCall(c["name"], c["arguments"], c.get("id", ""))
                 for c in m.additional_kwargs.get("tool_calls") or []
                 if isinstance(c, dict) and "name" in c and "arguments" in c]
        if calls:
            turn["tool_calls"] = calls
        if m.role.value == "tool":
            turn.update({k: m.additional_kwargs[k] for k in ("tool_call_id", "name")
                         if m.additional_kwargs.get(k)})
        chat.append(turn)
    return chat


def _accumulate(chunks: Any) -> Any:
    """Pairs of (chunk, text so far): LlamaIndex streams cumulative text plus a delta."""
    text = ""
    for chunk in chunks:
        text += chunk.text
        yield chunk, text


async def _aaccumulate(chunks: Any) -> Any:
    text = ""
    async for chunk in chunks:
        text += chunk.text
        yield chunk, text


def _details(completion: Completion | None) -> dict[str, Any]:
    if completion is None:
        return {}
    return {**completion.usage(), "finish_reason": completion.api_finish_reason,
            "ended_by": completion.finish_reason, **completion.speculation()}


def _completion_response(result: Any, text: str | None = None,
                         delta: str | None = None) -> CompletionResponse:
    """A response from a Completion, or from a stream Chunk with the text so far."""
    completion = result if isinstance(result, Completion) else result.completion
    details = _details(completion)
    return CompletionResponse(text=result.text if text is None else text, delta=delta,
                              additional_kwargs=details, raw=details or None)


def _chat_response(result: Any, text: str | None = None, delta: str | None = None,
                   form: CallFormat | None = None) -> ChatResponse:
    """A response; with tools offered, the calls move from the text into the message's
    ``additional_kwargs["tool_calls"]`` (id, name, arguments): a finished answer's as its
    Completion parsed them, a stream's so far as ``form`` reads them."""
    reply = _completion_response(result, text, delta)
    completion = result if isinstance(result, Completion) else result.completion
    content, made = (completion.content, completion.calls) if completion is not None else \
        form.parse(reply.text) if form is not None else (reply.text, [])
    extra: dict[str, Any] = {"tool_calls": [{"id": c.id, "name": c.name,
                                             "arguments": c.arguments}
                                            for c in made]} if made else {}
    if completion is not None and completion.cut_call is not None:
        extra["cut_tool_call"] = {"name": completion.cut_call.name,
                                  "arguments": completion.cut_call.arguments}
    return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content,
                                            additional_kwargs=extra),
                        delta=delta, additional_kwargs=reply.additional_kwargs, raw=reply.raw)
