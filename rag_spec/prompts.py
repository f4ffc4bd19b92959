"""Chat prompts for retrieval-augmented answers, built with the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rag_spec.retrieval.types import Hit

SYSTEM = "You answer questions about Python using the documentation given."


def format_context(hits: Sequence[Hit]) -> str:
    """The passages, each under its title (small models follow this better than numbering)."""
    return "\n\n".join(f"Documentation of {hit.title}:\n{hit.text}" for hit in hits)


def rag_messages(question: str, hits: Sequence[Hit]) -> list[dict[str, str]]:
    """System + user messages: the passages, then the question."""
    user = f"{format_context(hits)}\n\n{question}" if hits else question
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def merge_turns(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Join consecutive messages of one role: many chat templates insist that roles alternate.
    Tool results and turns carrying tool calls stay whole (each answers or names one call)."""
    merged: list[dict[str, Any]] = []
    for message in messages:
        if merged and _plain(merged[-1]) and _plain(message) and \
                merged[-1]["role"] == message["role"]:
            merged[-1]["content"] += "\n\n" + message["content"]
        else:
            merged.append(dict(message))
    return merged


def _plain(message: Mapping[str, Any]) -> bool:
    return message["role"] != "tool" and set(message) == {"role", "content"}


def chat_input_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                   tools: Sequence[dict[str, Any]] | None = None) -> list[int]:
    """Token ids of ``messages`` with the generation prompt appended (``tools``: for a chat
    template with a tools section)."""
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": list(tools)} if tools else {}
        encoded = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True,
                                                tokenize=True, return_dict=True, **extra)
        return list(encoded["input_ids"])
    text = "\n\n".join(m["content"] for m in messages) + "\n\nAnswer:"
    return list(tokenizer(text)["input_ids"])
