"""``rag-spec bench agent``: one LangChain agent (``create_agent``: LangGraph underneath) with two
tools, a documentation search over the default knowledge base and a word count, on held-out
tasks; the model under it is ``ChatLookahead`` (our decoder as a user gets it), the same
without drafts, or the peer. Wall time per task, tokens per second per model turn, the
prefill's share of each turn, and whether each transcript equals the peer's.

On the GGUF weights (what the embedded model decodes by default) a turn reads the entries of
the conversation's earlier prompt instead of computing them (``prefix_cache_mb``): the same
agent there with and without stored prefixes gives what that saves per turn and per task, and
whether the transcripts stay the same (they must: a token's entries are the same in any pass).

The peer is what a user has without rag-spec for a local model that must call tools:
transformers ``generate``, one token a pass, under xgrammar's logits processor for the same
tools' grammar, on the same prompt (``GenerateChat``). ``ChatHuggingFace`` over a local
pipeline makes no tool calls (it has no grammar and parses none), so its agent would not run
a tool loop at all.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, BaseMessage
from langchain_core.outputs import ChatGeneration, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool, tool
from langchain_core.utils.function_calling import convert_to_openai_tool
from pydantic import ConfigDict, Field

from langchain_rag_spec import ChatLookahead, SpecRetriever, tools_first
from langchain_rag_spec.chat_models import chat_turns
from rag_spec import GenerateOptions, LocalLM, Tool, tool_options
from rag_spec.bench.prompts import HELD_OUT_RAG_QUESTIONS
from rag_spec.bench.report import (
    DEQUANTIZED,
    figure,
    machine,
    median,
    publish,
    save_figure,
    setting,
)

COUNTING = ["How many words are in 'the quick brown fox jumps'?",
            "Count the words in 'to be or not to be'.",
            "How many words does 'a stitch in time saves nine' have?"]
SYSTEMS = ("hf_xgrammar", "rag_spec_no_drafts", "rag_spec")
# the default decoder on the file's own weights, without and with stored prompt prefixes
STORED = ("rag_spec_gguf_no_prefixes", "rag_spec_gguf")


def agent_tools(retriever: Any) -> list[BaseTool]:
    """The agent's two tools; their strings are bounded (a small model may otherwise write a
    string that never ends, which a grammar of an unbounded schema cannot close)."""

    @tool
    def search_python_docs(query: Annotated[str, Field(max_length=40)]) -> str:
        """Search the Python standard library's documentation."""
        return "\n\n".join(d.page_content for d in retriever.invoke(query))

    @tool
    def word_count(text: Annotated[str, Field(max_length=60)]) -> int:
        """Count the words in a text."""
        return len(text.split())

    return [search_python_docs, word_count]


class GenerateChat(BaseChatModel):
    """transformers ``generate`` on the model behind ``lm``, one token a pass, under
    xgrammar's logits processor for the bound tools' grammar, on the prompt ``ChatLookahead``
    renders: the tokens ``ChatLookahead`` must equal, at the peer's speed."""

    model_config = ConfigDict(arbitrary_types_allowed=True)
    lm: Any  # rag_spec.LocalLM
    max_tokens: int = 128

    @property
    def _llm_type(self) -> str:
        return "generate-xgrammar"

    def bind_tools(self, tools: Sequence[Any], *, tool_choice: Any = None,
                   **kwargs: Any) -> Runnable:
        return self.bind(tools=[convert_to_openai_tool(t) for t in tools],
                         tool_choice=tool_choice, **kwargs)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: Any = None, **kwargs: Any) -> ChatResult:
        import torch
        import xgrammar as xgr

        lm: LocalLM = self.lm
        options = GenerateOptions(max_new_tokens=self.max_tokens,
                                  **tool_options(kwargs.get("tools"), kwargs.get("tool_choice")))
        prompt = lm.encode(chat_turns(messages), options.tools)
        model, tokenizer = lm.lm.model, lm.lm.tokenizer
        processors = []
        if options.tools:
            offered = [Tool.from_openai(spec) for spec in json.loads(options.tools)]
            grammar = lm.call_format.grammar(offered, options.tool_choice)
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=model.get_input_embeddings().num_embeddings)
            compiled = xgr.GrammarCompiler(info).compile_grammar(grammar)
            processors = [xgr.contrib.hf.LogitsProcessor(compiled)]
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=self.max_tokens, logits_processor=processors)
        new = out[0, len(prompt):].tolist()
        eos = model.generation_config.eos_token_id
        ended = eos in new
        text = tokenizer.decode(new[:new.index(eos)] if ended else new, skip_special_tokens=True)
        content, calls = lm.call_format.parse(text) if options.tools else (text, [])
        message = AIMessage(content=content, tool_calls=[
            {"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"}
            for c in calls], response_metadata={"finish_reason": "stop" if ended else "length",
                                                "completion_tokens": len(new)})
        return ChatResult(generations=[ChatGeneration(message=message)])


def transcript(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """An agent's messages without their ids (a call's id is drawn anew each run): what two
    runs of the same agent must agree on."""
    return [{"type": m.type, "content": m.content,
             "tool_calls": [(c["name"], c["args"]) for c in getattr(m, "tool_calls", [])]}
            for m in messages]


def run(json_out: str | None = None, limit: int = 6, max_new_tokens: int = 128) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON and a PNG plot; return the report."""
    from langchain.agents import create_agent

    tools = agent_tools(SpecRetriever(k=2))
    tasks = [*HELD_OUT_RAG_QUESTIONS[:limit - limit // 3], *COUNTING[:limit // 3]]
    # the peer's weights (float32): its transcripts are what ours must equal
    chat = ChatLookahead(max_tokens=max_new_tokens, lookahead=DEQUANTIZED)
    models = {"hf_xgrammar": GenerateChat(lm=chat.local_lm(), max_tokens=max_new_tokens),
              "rag_spec_no_drafts": ChatLookahead(max_tokens=max_new_tokens,
                                                  lookahead={**DEQUANTIZED, "budget": 0}),
              "rag_spec": chat,
              "rag_spec_gguf_no_prefixes": ChatLookahead(max_tokens=max_new_tokens,
                                                         lookahead={"prefix_cache_mb": 0}),
              "rag_spec_gguf": ChatLookahead(max_tokens=max_new_tokens)}
    agents = {name: create_agent(model, tools, middleware=[tools_first()])
              for name, model in models.items()}
    for agent in agents.values():  # first-use costs (grammars compiled, kernels) off the clock
        agent.invoke({"messages": [("user", "How do I read a file?")]})
    names = (*SYSTEMS, *STORED)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for i, task in enumerate(tasks):
        order = names[i % len(names):] + names[:i % len(names)]  # interleaved, each first in turn
        for name in order:
            started = time.perf_counter()
            messages = agents[name].invoke({"messages": [("user", task)]})["messages"]
            runs[name].append({"seconds": time.perf_counter() - started,
                               "turns": _turns(messages), "transcript": transcript(messages)})
    report: dict[str, Any] = {"model": chat.model, "dtype": str(chat.local_lm().lm.dtype),
                              "max_new_tokens": max_new_tokens,
                              "tasks": len(tasks), "machine": machine(), "systems": {}}
    peer = runs["hf_xgrammar"]
    for name in SYSTEMS:
        mine = runs[name]
        report["systems"][name] = {
            "median_seconds": round(median([r["seconds"] for r in mine]), 3),
            "speedup": round(median([p["seconds"] / r["seconds"]
                                     for p, r in zip(peer, mine)]), 3),
            "identical_answers": sum(p["transcript"] == r["transcript"]
                                     for p, r in zip(peer, mine)),
            "tool_calls": sum(len(m["tool_calls"]) for r in mine for m in r["transcript"]),
            "per_task_seconds": [round(r["seconds"], 3) for r in mine],
            "turns": [r["turns"] for r in mine]}
    ours = [t for r in runs["rag_spec"] for t in r["turns"] if "prefill_share" in t]
    report["prefill_share"] = round(median([t["prefill_share"] for t in ours]), 3)
    report["prefix_reuse"] = _prefix_reuse(runs)
    publish(report, json_out, "agent", _plot, _print_table)
    return report


def _prefix_reuse(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """What stored prompt prefixes save on the GGUF weights: per task (median of ratios), per
    later model turn (its prompt's share read, its prefill's seconds and share of the turn),
    and whether the transcripts are the same with and without them."""
    without = runs[STORED[0]]

    def later(name: str, key: str) -> float:
        return median([t[key] for r in runs[name] for t in r["turns"][1:]])

    rows: dict[str, Any] = {"weights": "GGUF"}
    for name in STORED:
        mine = runs[name]
        rows[name] = {
            "median_seconds": round(median([r["seconds"] for r in mine]), 3),
            "speedup": round(median([a["seconds"] / b["seconds"]
                                     for a, b in zip(without, mine)]), 3),
            "identical_answers": sum(a["transcript"] == b["transcript"]
                                     for a, b in zip(without, mine)),
            "later_turn_read": round(median([t["cached_prompt_tokens"] / t["prompt_tokens"]
                                             for r in mine for t in r["turns"][1:]]), 3),
            "later_turn_prefill_seconds": round(later(name, "prefill_seconds"), 4),
            "later_turn_prefill_share": round(later(name, "prefill_share"), 3)}
    return rows


def _turns(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Each model turn's tokens and, where the model reports them (ours), its tokens per
    second and the share of its time spent on the prefill."""
    turns = []
    for m in messages:
        if m.type != "ai":
            continue
        meta = m.response_metadata
        spec = meta.get("speculation")
        turn: dict[str, Any] = {"tokens": (m.usage_metadata or {}).get(
            "output_tokens", meta.get("completion_tokens"))}
        if spec is not None:
            turn["tok_per_s"] = spec["tokens_per_second"]
            turn["tokens_per_step"] = spec["tokens_per_step"]
            turn["prefill_share"] = spec.get("prefill_share")
            turn["prefill_seconds"] = spec.get("prefill_seconds")
            turn["prompt_tokens"] = (m.usage_metadata or {}).get("input_tokens")
            turn["cached_prompt_tokens"] = spec.get("cached_prompt_tokens")
        turns.append(turn)
    return turns


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, ax = figure()
    names = list(report["systems"])
    ax.bar(names, [report["systems"][n]["speedup"] for n in names], color="#4c72b0")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("speedup per task vs generate + xgrammar (median)")
    save_figure(fig, path, f"agent: {report['tasks']} tasks, {setting(report)}")


def _print_table(report: dict[str, Any]) -> None:
    print(f"{'system':<20} {'s/task':>8} {'speedup':>8} {'identical':>10} {'calls':>6}")
    for name, row in report["systems"].items():
        print(f"{name:<20} {row['median_seconds']:>8.2f} {row['speedup']:>7.2f}x "
              f"{row['identical_answers']:>6}/{report['tasks']} {row['tool_calls']:>6}")
    print(f"prefill share of our model turns (median): {report['prefill_share']:.0%}")
    reuse = report["prefix_reuse"][STORED[1]]
    print(f"GGUF weights, stored prompt prefixes: {reuse['speedup']:.2f}x per task, "
          f"{reuse['later_turn_read']:.0%} of a later turn's prompt read, transcripts "
          f"identical {reuse['identical_answers']}/{report['tasks']}")
