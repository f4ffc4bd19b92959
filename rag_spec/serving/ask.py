"""One-shot RAG: retrieve passages for a question, then answer it with the local model, or
with a model behind an OpenAI-compatible server (``ask_served``)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from rag_spec.errors import RagSpecError
from rag_spec.models.loader import LoadedModel
from rag_spec.prompts import chat_input_ids, rag_messages
from rag_spec.retrieval.types import Hit, Retriever
from rag_spec.serving.drafts import drafter_for
from rag_spec.serving.served_model import ServedModel


@dataclass
class Answer:
    """An answer with the passages it was given and where the time went."""

    text: str
    token_ids: list[int]
    hits: list[Hit]
    retrieval_seconds: float
    generation_seconds: float
    stats: dict = field(default_factory=dict)
    finish_reason: str = "eos"  # "eos", "stop" or "length" (cut at the token limit)

    @property
    def tokens_per_second(self) -> float:
        return len(self.token_ids) / max(self.generation_seconds, 1e-9)


def ask(lm: LoadedModel, retriever: Retriever, question: str, *, k: int = 3,
        max_new_tokens: int = 256, on_text: Callable[[str], None] | None = None,
        draft: Any = None, json_schema: Any = None,
        quantized: bool | Literal["auto"] = "auto") -> Answer:
    """Retrieve ``k`` passages, then answer greedily, streaming text pieces to ``on_text``
    (``draft``: see ``rag_spec.serving.drafts.drafter_for``; None: the decoder's default), as
    JSON under ``json_schema`` if one is given; ``quantized``: from the model's GGUF weights
    (``LookaheadConfig.quantized``: by default wherever that applies)."""
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder

    hits, started, retrieved = _retrieved(retriever, question, k)
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(quantized=quantized),
                               drafter=drafter_for(draft, lm))
    decoder.add_context([hit.text for hit in hits])
    prompt = chat_input_ids(lm.tokenizer, rag_messages(question, hits))
    result = decoder.generate(prompt, max_new_tokens=max_new_tokens, streamer=on_text,
                              json_schema=json_schema)
    generated = time.perf_counter()
    return Answer(text=result.text, token_ids=result.token_ids, hits=hits,
                  retrieval_seconds=retrieved - started, generation_seconds=generated - retrieved,
                  stats=result.stats.as_dict(), finish_reason=result.finish_reason)


def _retrieved(retriever: Retriever, question: str, k: int) -> tuple[list[Hit], float, float]:
    """The question's ``k`` passages, and when their search started and ended."""
    if not question.strip():
        msg = 'The question is empty. Ask something, e.g. rag-spec ask "How do I join paths?"'
        raise RagSpecError(msg)
    started = time.perf_counter()
    hits = retriever.search([question], k=k)[0]
    return hits, started, time.perf_counter()


def ask_served(served: ServedModel, retriever: Retriever, question: str, *, k: int = 3,
               max_new_tokens: int = 256, on_text: Callable[[str], None] | None = None,
               json_schema: Any = None) -> Answer:
    """``ask`` with the answer from ``served``'s chat route (any OpenAI-compatible server:
    ``rag-spec serve``, llama.cpp's, vLLM, Ollama): the passages are retrieved here and sent
    in the same messages ``ask`` renders. ``stats`` holds the server's token counts (no token
    ids: the chat route sends text)."""
    hits, started, retrieved = _retrieved(retriever, question, k)
    if isinstance(json_schema, str):
        json_schema = json.loads(json_schema)
    elif isinstance(json_schema, type):  # a Pydantic model class
        json_schema = json_schema.model_json_schema()
    answer = served.chat(rag_messages(question, hits), max_new_tokens, on_text=on_text,
                         json_schema=json_schema)
    generated = time.perf_counter()
    usage = answer.usage
    stats = {"completion_tokens": usage.get("completion_tokens"),
             "prompt_tokens": usage.get("prompt_tokens"),
             "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}
    return Answer(text=answer.text, token_ids=[], hits=hits,
                  retrieval_seconds=retrieved - started, generation_seconds=generated - retrieved,
                  stats=stats, finish_reason="length" if answer.finish_reason == "length"
                  else "eos")
