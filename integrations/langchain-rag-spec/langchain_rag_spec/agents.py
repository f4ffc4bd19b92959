"""Agents on a small local model: LangChain's ``create_agent`` (LangGraph underneath) with
``ChatLookahead``, which offers the tools and decodes each call under a grammar of its schema.

A small model left to choose (``tool_choice="auto"``) mostly answers a question itself rather
than call a tool (the embedded 135M model answered every weather question of LangChain's
standard agent test in text). ``tools_first`` makes the model call a tool on the turn that
answers a person's message and choose freely once results came back: the agent loop
LangChain runs, with the calls a larger model would decide on made sure.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from langchain.agents.middleware import AgentMiddleware, ModelRequest, ModelResponse


class ToolsFirst(AgentMiddleware):
    """``create_agent`` middleware: a model call that answers a person's message must call
    a tool (``tool_choice="any"``); after a tool's result the agent's own choice stands (by
    default "auto": the model answers, or calls again)."""

    def wrap_model_call(self, request: ModelRequest,
                        handler: Callable[[ModelRequest], ModelResponse]) -> ModelResponse:
        return handler(_forced(request))

    async def awrap_model_call(self, request: ModelRequest,
                               handler: Callable[[ModelRequest], Any]) -> ModelResponse:
        return await handler(_forced(request))


def _forced(request: ModelRequest) -> ModelRequest:
    last = request.messages[-1] if request.messages else None
    if request.tools and last is not None and last.type == "human":
        return request.override(tool_choice="any")
    return request


def tools_first() -> ToolsFirst:
    """The middleware: ``create_agent(ChatLookahead(), tools, middleware=[tools_first()])``."""
    return ToolsFirst()
