"""``rag-spec bench structured``: JSON under a schema (every string bounded, so an answer closes
within the token limit), ours against transformers ``generate`` with xgrammar's logits
processor (the peer a user would pick), beside our own constrained decoding without drafts
(the ablation).

Two prompt sets, held out from the lookahead bench's questions: extraction (a question's top
retrieved passages -> a JSON record of the API they describe) and tool calls (a question -> a
call of one of two tools, as JSON). Every output is checked: it must parse and validate, and
equal the ablation's token for token.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import torch
from pydantic import BaseModel, Field

from rag_spec.bench.prompts import RAG_QUESTIONS
from rag_spec.bench.report import (
    Run,
    dequantized,
    interleaved,
    machine,
    median,
    publish,
    runs_pass_statistics,
    setting,
)

_HELD_OUT = 12  # the lookahead bench reads the first questions; these come after them


class ApiRecord(BaseModel):
    """What an extraction prompt asks for."""

    name: str = Field(description="the dotted name of the function or class", max_length=60)
    module: str = Field(max_length=40)
    summary: str = Field(description="one sentence", max_length=160)
    arguments: list[Annotated[str, Field(max_length=30)]] = Field(max_length=6)


class _SearchArgs(BaseModel):
    query: str = Field(max_length=80)
    k: int = Field(ge=1, le=20)


class SearchDocs(BaseModel):
    name: Literal["search_docs"]
    arguments: _SearchArgs


class _CodeArgs(BaseModel):
    code: str = Field(max_length=200)


class RunCode(BaseModel):
    name: Literal["run_python"]
    arguments: _CodeArgs


class ToolCall(BaseModel):
    """One call of either tool (a JSON object with the tool's name and its arguments)."""

    call: SearchDocs | RunCode


TOOLS_TEXT = ("Tools: search_docs(query: str, k: int) searches the Python documentation; "
              "run_python(code: str) runs a snippet. Answer with one tool call as JSON: "
              '{"call": {"name": ..., "arguments": {...}}}.')


def run(json_out: str | None = None, limit: int = 8, max_new_tokens: int = 256,
        model_name: str | None = None) -> dict[str, Any]:
    from rag_spec.engine.decoder import LookaheadDecoder
    from rag_spec.models import load_model
    from rag_spec.models.registry import DEFAULT_MODEL
    from rag_spec.prompts import chat_input_ids
    from rag_spec.retrieval import KnowledgeBase

    lm = load_model(model_name or DEFAULT_MODEL)
    questions = RAG_QUESTIONS[_HELD_OUT:_HELD_OUT + limit]
    hits = KnowledgeBase.load_default("flat").search(questions, k=2)
    sets = {
        "extraction": (ApiRecord, [chat_input_ids(lm.tokenizer, [{"role": "user", "content": (
            "Passages:\n" + "\n\n".join(f"{h.title}: {h.text}" for h in found)
            + f"\n\nQuestion: {q}\nFrom the passages, give the API that answers it as JSON "
              f"with name, module, summary and arguments.")}])
            for q, found in zip(questions, hits)]),
        "tool_call": (ToolCall, [chat_input_ids(lm.tokenizer, [
            {"role": "system", "content": TOOLS_TEXT}, {"role": "user", "content": q}])
            for q in questions]),
    }
    ours = LookaheadDecoder(lm.model, lm.tokenizer, dequantized())  # the peer's weights
    ablation = LookaheadDecoder(lm.model, lm.tokenizer, dequantized(budget=0))
    report: dict[str, Any] = {"benchmark": "structured", "model": model_name or DEFAULT_MODEL,
                              "dtype": str(lm.dtype), "max_new_tokens": max_new_tokens,
                              "machine": machine()}
    for name, (schema, prompts) in sets.items():
        print(f"{name}: {len(prompts)} prompts")
        systems = _systems(lm, schema, {"rag_spec": ours, "rag_spec_no_drafts": ablation},
                           max_new_tokens)
        for system in systems.values():  # first-use costs (grammar compiling) off the clock
            system(prompts[0])
        runs = interleaved(systems, prompts)
        report[name] = _summarise(lm.tokenizer, schema, runs)
    # DESIGN.md's top-level keys: the extraction set's (tool calls under "tool_call")
    report["prompts"] = report["extraction"]["prompts"]
    report["systems"] = report["extraction"]["systems"]
    publish(report, json_out, "structured", _plot, _print_table)
    return report


def _systems(lm: Any, schema: type[BaseModel], decoders: dict[str, Any],
             max_new_tokens: int) -> dict[str, Any]:
    import xgrammar as xgr

    from rag_spec.engine.verify.grammar import GrammarRequest, Grammars

    eos = lm.model.generation_config.eos_token_id
    stop = [eos] if isinstance(eos, int) else list(eos or [])
    compiled = Grammars.of(lm.tokenizer, lm.model.get_input_embeddings().num_embeddings,
                           stop).compile(GrammarRequest(json_schema=schema))

    def peer(prompt: list[int]) -> Run:
        ids = torch.tensor([prompt], device=lm.model.device)
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=max_new_tokens,
                                logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)])
        new = out[0, len(prompt):].tolist()
        return Run(0.0, new[:new.index(stop[0]) + 1] if stop and stop[0] in new else new)

    def ours(decoder: Any) -> Any:
        def call(prompt: list[int]) -> Run:
            result = decoder.generate(prompt, max_new_tokens, json_schema=schema)
            return Run(0.0, result.token_ids, {"stats": [result.stats]})
        return call

    return {"hf_xgrammar": peer, **{name: ours(d) for name, d in decoders.items()}}


def _summarise(tokenizer: Any, schema: type[BaseModel], runs: dict[str, list[Any]]
               ) -> dict[str, Any]:
    peer = runs["hf_xgrammar"]
    reference = runs["rag_spec_no_drafts"]
    systems = {}
    for name, mine in runs.items():
        ratios = [(len(m.tokens) / m.seconds) / (len(p.tokens) / p.seconds)
                  for m, p in zip(mine, peer)]
        valid = sum(_valid(tokenizer, schema, m.tokens) for m in mine)
        systems[name] = {
            "tok_per_s": round(sum(len(m.tokens) for m in mine) / sum(m.seconds for m in mine), 2),
            "speedup_vs_peer": round(median(ratios), 3),
            "valid": valid,
            "identical_to_nodraft": sum(m.tokens == r.tokens for m, r in zip(mine, reference)),
            **(runs_pass_statistics(mine) or {"tokens_per_step": 1.0}),
            "per_prompt_speedup": [round(r, 3) for r in ratios],
        }
    return {"prompts": len(peer), "systems": systems}


def _valid(tokenizer: Any, schema: type[BaseModel], tokens: list[int]) -> bool:
    try:
        schema.model_validate_json(tokenizer.decode(tokens, skip_special_tokens=True))
    except ValueError:
        return False
    return True


def _plot(report: dict[str, Any], path: Path) -> None:
    from rag_spec.bench.report import figure, save_figure

    sets = [s for s in ("extraction", "tool_call") if s in report]
    fig, axes = figure(ncols=len(sets), size=(5 * len(sets), 3.6), squeeze=False)
    for ax, name in zip(axes[0], sets):
        systems = report[name]["systems"]
        ax.bar(list(systems), [s["speedup_vs_peer"] for s in systems.values()],
               color=["#888", "#2a7", "#7a9"][:len(systems)])
        for i, s in enumerate(systems.values()):
            ax.text(i, s["speedup_vs_peer"], f"{s['speedup_vs_peer']:.2f}x\n"
                    f"{s['tokens_per_step']:.2f} tok/pass", ha="center", va="bottom", fontsize=8)
        ax.set_ylim(0, 1.3 * max(s["speedup_vs_peer"] for s in systems.values()))
        ax.set_title(f"{name} ({report[name]['prompts']} prompts)")
        ax.set_ylabel("speedup vs generate + xgrammar (median)")
    save_figure(fig, path, f"bench structured: {setting(report)}")


def _print_table(report: dict[str, Any]) -> None:
    for name in ("extraction", "tool_call"):
        print(f"\n{name}:")
        for system, s in report[name]["systems"].items():
            print(f"  {system:20} {s['tok_per_s']:6.1f} tok/s  {s['speedup_vs_peer']:5.2f}x  "
                  f"valid {s['valid']}/{report[name]['prompts']}  identical "
                  f"{s['identical_to_nodraft']}/{report[name]['prompts']}  "
                  f"{s['tokens_per_step']:.2f} tokens/pass")
