"""The settings ChatLookahead and LookaheadLLM share, and their translation to rag_spec."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.documents import Document
from langchain_core.language_models import LangSmithParams
from pydantic import BaseModel, Field, model_validator
from typing_extensions import Self

from rag_spec import (
    DEFAULT_MODEL,
    Completion,
    GenerateOptions,
    LocalLM,
    LookaheadConfig,
    tool_options,
)

_OPTION_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed")


class LookaheadSettings(BaseModel):
    """Model and decoding settings; every decoding field can also be passed per call."""

    model: str = DEFAULT_MODEL
    """Embedded model name (see ``rag-spec models list``) or a local Hugging Face folder."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Passed to ``rag_spec.load_model``: ``device`` ("cpu", "cuda", "auto"), ``dtype``."""
    lookahead: dict[str, Any] = Field(default_factory=dict)
    """``rag_spec.LookaheadConfig`` fields, e.g. ``{"budget": 16}``."""
    draft_model: Any = None
    """A draft model of the same vocabulary (embedded name, folder, or model object), or
    ``"early-exit:L"`` (the model's own first L layers); merged with the trie's drafts. None:
    the default, the model's draft head + the trie where it has one (the embedded model
    does), else the trie."""
    max_tokens: int = 256
    temperature: float = 0.0
    """0 decodes greedily; above 0 samples (losslessly, from the model's own distribution)."""
    top_p: float = 1.0
    top_k: int = 0
    repetition_penalty: float = 1.0
    stop: list[str] | None = None
    seed: int | None = None
    """Fixes sampled output (drafts never change it)."""

    @model_validator(mode="after")
    def _check_options(self) -> Self:
        """Refused when built, in the decoder's words, not at the first call."""
        self.options(None, {})
        return self

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, **self.options(None, {}).decoder_kwargs()}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)  # type: ignore[misc]
        params["ls_provider"] = "rag_spec"
        return params

    def local_lm(self) -> LocalLM:
        """The process-wide model behind this object (loaded on first use)."""
        return LocalLM.shared(self.model, config=LookaheadConfig(**self.lookahead),
                              draft=self.draft_model, **self.model_kwargs)

    def options(self, stop: Sequence[str] | None, overrides: dict[str, Any]) -> GenerateOptions:
        """This object's settings, with per-call ``stop`` and keyword overrides applied."""
        values = {name: overrides.get(name, getattr(self, name)) for name in _OPTION_FIELDS}
        stops = [*(self.stop or ()), *(stop or ())]
        # bound with bind_tools: offered in the prompt, calls decoded under a grammar
        tools = tool_options(overrides.get("tools"), overrides.get("tool_choice"),
                             parallel=bool(overrides.get("parallel_tool_calls")))
        return GenerateOptions(max_new_tokens=values.pop("max_tokens"), stop=tuple(stops),
                               json_schema=overrides.get("json_schema"), **tools, **values)

    def with_context(self, documents: Sequence[Document | str]) -> Any:
        """A copy that may copy text from ``documents`` (e.g. retrieved passages that are not
        in the prompt); speculation drafts from them, the output does not change."""
        texts = [d.page_content if isinstance(d, Document) else d for d in documents]
        return self.bind(context=texts)  # type: ignore[attr-defined]


def response_metadata(completion: Completion, model: str) -> dict[str, Any]:
    """What a caller sees about one generation: model, why it ended (``finish_reason`` in the
    OpenAI API's words; ``ended_by``: "eos", a "stop" string or the "length" limit), and
    speculation stats."""
    return {"model_name": model, "model_provider": "rag_spec",
            "finish_reason": completion.api_finish_reason,
            "ended_by": completion.finish_reason, "speculation": completion.speculation()}


def usage(completion: Completion) -> dict[str, Any]:
    """LangChain's names for the token counts (``cache_read``: prompt tokens read from the
    decoder's stored prefixes)."""
    counts = completion.usage()
    return {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
            "total_tokens": counts["total_tokens"], "input_token_details": {
                "cache_read": counts["prompt_tokens_details"]["cached_tokens"]}}
