"""The benchmarks page and the README's "How fast" table, rendered from the benches' JSON.

``python -m rag_spec.bench.page`` (``make bench-page``) writes ``docs/benchmarks/README.md`` and
the table between README.md's ``how-fast`` markers from the JSON files in ``docs/benchmarks/``;
``--check`` writes nothing and exits 1 where either differs from what it would write (a test
runs it). No figure on either page is typed by hand: a bench that is run again changes them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rag_spec.bench.report import REPORT_DIR

README = Path("README.md")
START, END = "<!-- how-fast: python -m rag_spec.bench.page -->", "<!-- /how-fast -->"


@dataclass(frozen=True)
class Bench:
    """A report on the page: its JSON's name, the section's title and what it measures."""

    name: str
    title: str
    about: str


BENCHES = (
    Bench("lookahead", "Speculative decoding",
          "Greedy decoding of RAG prompts (a standard-library question and its top-3 "
          "passages) and open-ended ones, 128 new tokens: transformers `generate`, its prompt "
          "lookup, our decoder (`rag_spec`) and its ablations, on the same model's float32 "
          "weights; and, under `gguf`, our decoding of the model's GGUF file's own weights (what "
          "a CPU user gets by default), drafting and not, against plain llama.cpp on the same "
          "file at its faster thread count, answers compared with our no-draft decoding of "
          "the file."),
    Bench("chain", "LangChain and LlamaIndex pipelines",
          "A RAG chain and a query engine end to end: the stock Hugging Face classes against "
          "ours (`SpecRetriever`, `ChatLookahead`, `LookaheadLLM`), the same answers."),
    Bench("agent", "An agent with tools",
          "A LangChain agent (`create_agent` with `tools_first`) with a documentation search "
          "over the default knowledge base and a word count, on held-out tasks: transformers "
          "`generate` under xgrammar's logits processor (`ChatHuggingFace` over a local "
          "pipeline makes no tool calls) against `ChatLookahead` and its no-draft ablation; "
          "wall time per task, each model turn's tokens per pass and prefill share, and "
          "whether each transcript equals the peer's; and, on the GGUF weights, the default "
          "agent with and without stored prompt prefixes (a later turn reads its "
          "conversation's earlier prompt instead of computing it), its transcripts against "
          "the same agent's without them."),
    Bench("serve", "rag-spec serve under concurrent clients",
          "The OpenAI-compatible server under 1-16 concurrent `openai` SDK clients on held-out "
          "RAG questions (greedy): aggregate tokens per second against one client, latency of "
          "whole answers, time to first token of streamed ones, and each answer against the "
          "same request sent alone; every request joins the batch in flight at its next step "
          "(continuous batching). llama.cpp's server (llama-cpp-python's `[server]` extra, "
          "which answers one request at a time) on the same GGUF file is the peer, at its "
          "faster thread count, where it is installed; the JSON's `llama_cpp_server` says "
          "whether it was."),
    Bench("structured", "Structured output",
          "JSON under a schema and tool calls: `generate` with xgrammar's logits processor "
          "against our constrained decoding, with and without drafts."),
    Bench("draft", "Draft models and early exits",
          "Draft models (the model's first layers), early exits and merged trees against "
          "transformers' assisted generation, greedy, sampled and batched."),
    Bench("ralm_milvus_300ms", "Speculative retrieval, Milvus",
          "Iterative RaLM (a retrieval every 4 tokens) on a Milvus Lite collection behind "
          "300 ms: the naive loop against speculative retrieval and its ablations."),
    Bench("ralm_exact_300ms_served", "Speculative retrieval in front of a served model",
          "Iterative RaLM on the exact index behind 300 ms, both loops driving the embedded "
          "model behind `rag-spec serve` on loopback (`ServedModel`: each stride a request by "
          "token ids; on the GGUF weights the server reads the prompt it already computed for "
          "the stride before, so a stride computes only its new tokens, a rollback what "
          "follows the first changed passage): the naive loop against speculative retrieval "
          "and its ablations."),
    Bench("ralm_milvus_300ms_served", "Speculative retrieval in front of a served model, Milvus",
          "The same served loops with the passages in a Milvus Lite collection behind 300 ms. "
          "Strides stream; `strides cancelled` counts those closed mid-stream because a wrong "
          "guess behind them was found meanwhile."),
    Bench("ralm_bm25_300ms", "Speculative retrieval, BM25",
          "Iterative RaLM on a BM25 index behind 300 ms."),
    Bench("ralm_exact_5000000", "Speculative retrieval, exact dense at 5M passages",
          "Iterative RaLM on an exact dense index of 5 million passages (the real ones and "
          "distractors)."),
    Bench("knnlm_exact_1000000_k16", "kNN-LM, exact at 1M entries",
          "A kNN-LM retrieving at every token: the naive loop against speculation."),
    Bench("knnlm_exact_5000000_k16_float16", "kNN-LM, exact at 5M entries (float16 keys)",
          "The same at 5 million entries."),
    Bench("knnlm_keys", "kNN-LM keys",
          "Which hidden state makes the better key, on held-out text."),
    Bench("longctx_plain_first", "Long-context batches (MagicDec)",
          "Self-speculation through a StreamingLLM view of the KV cache, against transformers "
          "and our decoder without drafts, by batch and context length."),
    Bench("batch_ragged_4", "RAG questions in batches of 4",
          "Ragged RAG prompts decoded as one batch against transformers on the padded batch."),
    Bench("batch_ragged_8", "RAG questions in batches of 8", "The same, 8 rows a batch."),
    Bench("gpu_check_h100_8_layers", "On a GPU: 8 layers of a Llama-3-8B shape",
          "`make gpu-check` on an H100: greedy identity of every drafter, speculative "
          "sampling's distance from plain sampling, speed against `generate` (random weights: "
          "no draft is accepted, so this measures what drafting costs)."),
    Bench("gpu_check_h100_32_layers", "On a GPU: a whole Llama-3-8B shape",
          "The same check at 32 layers; its step costs by width are what the CPU benches' GPU "
          "projections read."),
)


SYSTEMS = {
    "hf": "transformers `generate`",
    "pld4": "`generate(prompt_lookup_num_tokens=4)`",
    "pld10": "`generate(prompt_lookup_num_tokens=10)`",
    "hf_assisted": "`generate(assistant_model=...)`",
    "hf_assisted_heuristic": "`generate(assistant_model=...)`, heuristic schedule",
    "hf_early_exit": "`generate(assistant_early_exit=...)`",
    "hf_xgrammar": "`generate` + xgrammar",
    "hf_prompt_lookup": "`generate(prompt_lookup_num_tokens=...)`",
    "rag_spec": "**rag_spec** (the default)",
    "naive": "the naive loop",
}

# (key, column heading), in the order columns appear
METRICS = (
    ("tok_per_s", "tok/s"), ("speedup_vs_hf", "vs `generate`"),
    ("speedup_vs_peer", "vs `generate` + xgrammar"), ("speedup_vs_naive", "vs naive"),
    ("speedup_vs_llama_cpp", "vs llama.cpp"),
    ("speedup_vs_no_drafts", "vs no drafts"), ("speedup", "speedup"),
    ("tokens_per_step", "tokens per pass"), ("kb_calls", "KB calls"),
    ("mean_stride", "stride"), ("rollbacks", "rollbacks"),
    ("prompt_tokens", "prompt tokens sent"), ("cached_tokens", "of them read, not computed"),
    ("cancelled_strides", "strides cancelled"),
    ("seconds_per_request", "s per question"), ("seconds_per_prompt", "s per prompt"),
    ("median_seconds", "median s"), ("p50_seconds", "p50 s"), ("p95_seconds", "p95 s"),
    ("ttft_p50_seconds", "first token p50 s"), ("ttft_p95_seconds", "first token p95 s"),
    ("knn_top1_accuracy", "nearest token right"),
    ("triton_ms", "Triton ms"), ("stock_sdpa_ms", "SDPA ms"), ("max_error", "max error"),
    ("identical_to_hf", "identical"), ("identical_to_naive", "identical"),
    ("identical_to_nodraft", "identical"), ("identical_answers", "identical"),
    ("identical_to_no_drafts", "identical"), ("identical_to_alone", "identical to alone"),
    ("tool_calls", "tool calls"), ("later_turn_read", "later turn's prompt read"),
    ("later_turn_prefill_seconds", "later turn's prefill s"),
    ("later_turn_prefill_share", "later turn's prefill share"),
    ("batch1", "identical, 1 row"),
    ("batch4", "identical, 4 rows"), ("valid", "valid"))
COUNTED = {"identical_to_hf", "identical_to_naive", "identical_to_nodraft", "identical_answers",
           "identical_to_alone",
           "identical_to_no_drafts", "batch1", "batch4", "valid"}
PARTS = {"rag": "RAG prompts", "open_ended": "open-ended prompts", "greedy": "greedy",
         "sampling": "sampled", "greedy_batch4": "greedy, batches of 4",
         "extraction": "JSON extraction", "tool_call": "tool calls", "speed": "speed",
         "greedy_identical": "greedy identity", "attention_kernel": "attention kernel",
         "keys": "keys", "langchain": "LangChain", "llamaindex": "LlamaIndex",
         "levels": "by concurrent clients",
         "llama_cpp_server": "llama.cpp's server on the same GGUF file",
         "gguf": "the GGUF file's weights, against plain llama.cpp",
         "prefix_reuse": "the GGUF weights, stored prompt prefixes against none"}
QUIET = {"benchmark", "command", "date", "machine", "systems", "prompts", "questions", "tasks",
         "commit", "data_commit"}


def load(name: str, directory: Path = REPORT_DIR) -> dict[str, Any]:
    return json.loads((directory / f"{name}.json").read_text())


def machine(report: dict[str, Any]) -> str:
    """The machine in a few words: the CPU where the report recorded it, or the GPU."""
    if "device" in report:
        return f"one {report['device']}"
    m = report.get("machine", {})
    cpu = m.get("cpu") or "CPU not recorded"
    if m.get("cpu_family"):
        cpu += f" (family {m['cpu_family']}, model {m['cpu_model']})"
    return f"{m.get('cpus', '?')}-core VM, {cpu}, torch {m.get('torch', '?')}"


def code(report: dict[str, Any]) -> str:
    """The code a report ran: the commit it recorded, or (a report from before benches
    recorded it) the commit that added its figures, whose code or its parent's ran."""
    if "commit" in report:
        return f"commit `{report['commit']}`"
    if "data_commit" in report:
        return (f"figures added in commit `{report['data_commit']}` (the code that commit or "
                f"its parent holds)")
    return "not recorded"


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2g}" if abs(value) < 0.1 else f"{value:.2f}" if abs(value) < 10 else (
            f"{value:.1f}")
    return str(value)


def _is_system(node: Any) -> bool:
    return isinstance(node, dict) and any(key in node for key, _ in METRICS)


def _label(key: str) -> str:
    return SYSTEMS.get(key) or PARTS.get(key) or f"`{key}`"


def _tables(node: Any, path: list[str], count: Any) -> Iterator[tuple[str, dict, Any]]:
    """Every table in a report: each dict holding two or more systems' figures, titled by
    where it sits; what a dict holds that one of its parts holds too (a report's copy of its
    first part, as DESIGN.md's top-level keys) is shown once, in the part."""
    if isinstance(node, list) and node and all(_is_system(x) and "clients" in x for x in node):
        yield " / ".join(path), {f"{x['clients']} client{'s' * (x['clients'] > 1)}": x
                                   for x in node}, count
        return
    if isinstance(node, list):
        for i, item in enumerate(node):
            if isinstance(item, dict):
                where = (f"batch {item['batch']} x {item['context']} tokens"
                         if "batch" in item and "context" in item else f"run {i + 1}")
                yield from _tables(item, [*path, where], count)
        return
    if not isinstance(node, dict):
        return
    count = node.get("prompts", node.get("questions", node.get("tasks", count)))
    rows = {k: v for k, v in node.items() if _is_system(v)}
    if len(rows) >= 2:
        yield " / ".join(path), rows, count
    parts = [v for v in node.values() if isinstance(v, dict)]
    copies = {key for key, value in node.items()
              if isinstance(value, dict) and any(part.get(key) == value for part in parts)}
    for key, value in node.items():
        if key in rows or key in copies or key == "machine":
            continue
        part = [] if key == "systems" else [PARTS.get(key, key.replace("_", " "))]
        yield from _tables(value, [*path, *part], count)


def _table(rows: dict[str, dict[str, Any]], count: Any) -> list[str]:
    columns = [(k, h) for k, h in METRICS if any(k in r for r in rows.values())]
    lines = ["| system | " + " | ".join(h for _, h in columns) + " |",
             "| --- |" + " ---: |" * len(columns)]
    for name, row in rows.items():
        cells = []
        for key, _ in columns:
            value = row.get(key)
            of = row.get("of", count)
            cells.append("" if value is None else
                         f"{value}/{of}" if key in COUNTED and of is not None else
                         f"{value:.2f}x" if key.startswith("speedup") else _number(value))
        lines.append(f"| {_label(name)} | " + " | ".join(cells) + " |")
    return lines


def _settings(report: dict[str, Any]) -> str:
    shown = [f"{k.replace('_', ' ')} {_number(v)}" for k, v in report.items()
             if k not in QUIET and not isinstance(v, (dict, list)) and len(str(v)) < 40]
    return "; ".join(shown)


def section(bench: Bench, report: dict[str, Any], directory: Path = REPORT_DIR) -> list[str]:
    """One bench's part of the page: what it measures, its command, machine and date, a plot
    where the bench drew one, and every table of its figures."""
    lines = [f"## {bench.title}", "", bench.about, ""]
    lines += [f"- command: `{report.get('command', '?')}`", f"- machine: {machine(report)}",
              f"- date: {report.get('date', '?')}; code: {code(report)}; data: "
              f"[`{bench.name}.json`]({bench.name}.json)"]
    if _settings(report):
        lines.append(f"- setting: {_settings(report)}")
    lines.append("")
    if (directory / f"{bench.name}.png").is_file():
        lines += [f"![{bench.title}]({bench.name}.png)", ""]
    for title, rows, count in _tables(report, [], None):
        if title:
            lines += [f"**{title}**", ""]
        lines += [*_table(rows, count), ""]
    return lines


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _system(report: dict[str, Any], part: str, name: str, key: str = "speedup_vs_hf") -> float:
    return report[part]["systems"][name][key]


def headline(directory: Path = REPORT_DIR, history: frozenset[str] = frozenset()) -> list[str]:
    """Each technique: the paper's figure, the peer a user would pick instead and ours, as
    measured here (each from its bench's JSON); rows whose data is in ``history`` say so."""
    look, chain, draft = (load(n, directory) for n in ("lookahead", "chain", "draft"))
    structured, longctx = load("structured", directory), load("longctx_plain_first", directory)
    ralm = {n: load(f"ralm_{n}", directory) for n in ("exact_5000000", "bm25_300ms",
                                                      "milvus_300ms")}
    knn = load("knnlm_exact_5000000_k16_float16", directory)
    papers = load("papers", directory)["papers"]  # what each paper reports, in its setting

    def loop(report: dict[str, Any]) -> str:
        s = report["systems"]
        return (f"{_x(s['spec_all']['speedup_vs_naive'])} "
                f"({_x(s['spec_all_lookahead']['speedup_vs_naive'])} with lookahead; bound "
                f"{_x(report['amdahl_bound'])} for retrieval alone)")

    greedy = draft["greedy"]
    magic = "; ".join(f"{r['batch']} x {r['context']}: {_x(r['self_spec_over_no_drafts'])} "
                      f"({_x(r['self_spec_over_hf'])} `generate`)" for r in longctx["runs"])
    rows = [
        ("trie + draft head drafts, tree verification", "lookahead",
         f"`prompt_lookup_num_tokens=4`: {_x(_system(look, 'rag', 'pld4'))} RAG, "
         f"{_x(_system(look, 'open_ended', 'pld4'))} open",
         f"**{_x(_system(look, 'rag', 'rag_spec'))} RAG, "
         f"{_x(_system(look, 'open_ended', 'rag_spec'))} open** `generate` "
         f"({_x(look['rag']['rag_spec_over_no_drafts'])} / "
         f"{_x(look['open_ended']['rag_spec_over_no_drafts'])} our no-draft decoding)",
         "lookahead"),
        ("LangChain RAG chain, drop-in", None, "`ChatHuggingFace` (the baseline)",
         f"{_x(chain['langchain']['speedup'])} end to end", "chain"),
        ("LlamaIndex query engine, drop-in", None, "`HuggingFaceLLM` (the baseline)",
         f"{_x(chain['llamaindex']['speedup'])} end to end", "chain"),
        ("JSON under a schema, tool calls", None, "`generate` + xgrammar (the baseline)",
         f"{_x(_system(structured, 'extraction', 'rag_spec', 'speedup_vs_peer'))} / "
         f"{_x(_system(structured, 'tool_call', 'rag_spec', 'speedup_vs_peer'))}",
         "structured"),
        ("speculative retrieval, exact dense, 5M passages", "ralm_exact", "the naive loop",
         loop(ralm["exact_5000000"]), "ralm_exact_5000000"),
        ("speculative retrieval, BM25 behind 300 ms", "ralm_bm25", "the naive loop",
         loop(ralm["bm25_300ms"]), "ralm_bm25_300ms"),
        ("speculative retrieval, Milvus behind 300 ms", None, "the naive loop",
         loop(ralm["milvus_300ms"]), "ralm_milvus_300ms"),
        ("speculative kNN-LM, exact, 5M entries", "knnlm", "the naive loop",
         _x(knn["systems"]["spec_all"]["speedup_vs_naive"]), "knnlm_exact_5000000_k16_float16"),
        ("draft-model trees (SpecInfer)", "specinfer",
         f"`assistant_model`: {_x(_system(greedy, 'rag', 'hf_assisted'))} RAG, "
         f"{_x(_system(greedy, 'open_ended', 'hf_assisted'))} open",
         f"{_x(_system(greedy, 'rag', 'rag_spec_draft_tree'))} / "
         f"{_x(_system(greedy, 'open_ended', 'rag_spec_draft_tree'))} (merged with the trie "
         f"{_x(_system(greedy, 'rag', 'rag_spec_merged'))} / "
         f"{_x(_system(greedy, 'open_ended', 'rag_spec_merged'))})", "draft"),
        ("sparse-KV self-speculation (MagicDec), over our own decoding", "magicdec",
         "our decoder without drafts on the same batch (in brackets: over `generate` on the "
         "padded batch)", magic, "longctx_plain_first"),
    ]
    lines = ["| technique | paper (setting) | peer measured here | rag-spec here | data |",
             "| --- | --- | --- | --- | --- |"]
    for technique, paper, peer, ours, data in rows:
        cited = f"{papers[paper]['figure']} ({papers[paper]['setting']})" if paper else "-"
        old = " (history: another VM, older code)" if data in history else ""
        lines.append(f"| {technique} | {cited} | {peer} | {ours} | "
                     f"[{data}](#{_anchor(data)}){old} |")
    return lines


def _history(reports: dict[str, dict[str, Any]]) -> set[str]:
    """Of ``reports`` (by name), the CPU benches run before benches recorded their CPU (on a
    VM that may differ from every other section's, on older code): the page shows them
    apart, as history."""
    return {name for name, report in reports.items()
            if "device" not in report and not report.get("machine", {}).get("cpu")}


def _anchor(name: str) -> str:
    title = next(b.title for b in BENCHES if b.name == name)
    return "".join(c for c in title.lower().replace(" ", "-") if c.isalnum() or c == "-")


def page(directory: Path = REPORT_DIR) -> str:
    """docs/benchmarks/README.md."""
    current = machine(load("lookahead", directory))
    reports = {bench.name: load(bench.name, directory) for bench in BENCHES}
    old = _history(reports)
    history = [b for b in BENCHES if b.name in old]
    others = sorted({machine(r) for r in reports.values() if "device" not in r
                     and machine(r) != current} - {machine(reports[b.name]) for b in history})
    lines = [
        "# Benchmarks", "",
        "<!-- generated by python -m rag_spec.bench.page from the JSON beside it; do not edit -->",
        "",
        "What rag-spec gains on the work its users run, against what they would run instead. "
        "Every figure comes from one run on one machine, systems interleaved per prompt (A B C, "
        "B C A, ...), medians of per-prompt ratios; each section names its command, machine "
        "and date, and its JSON holds every per-prompt value. \"identical\" counts outputs "
        "equal to the baseline's (`generate`, the naive loop); tokens per pass are means over "
        "prompts. Why the defaults are what they are: [Concepts](../concepts.md#why-the-defaults).",
        "", "## The headline", "",
        "The papers ran 7B-65B models on GPUs, where a pass over dozens of tokens costs about "
        "one; here a 135M model runs on two CPU cores, where a wide step costs more than a "
        "one-token one.", "", *headline(directory, frozenset(old)), "",
        f"The headline's decoding figures come from a {current}; "
        + (f"sections run on other machines ({'; '.join(others)}) say so, and their figures "
           f"compare only within their own section." if others else
           "so do the sections below but the GPU's and the history's."), ""]
    for bench in BENCHES:
        if bench not in history:
            lines += section(bench, reports[bench.name], directory)
    if history:
        lines += ["## History: other machines, older code", "",
                  f"Measured before benches recorded their CPU, on a VM that may not be the "
                  f"{current} above, and on older code (each section names its date and "
                  f"commit). Kept for the record: a figure here is comparable only with the "
                  f"others in its own section (`generate`'s own speed differs by up to 2x "
                  f"between VMs), until its bench is run again.", ""]
        for bench in history:
            lines += ["#" + line if line.startswith("## ") else line
                      for line in section(bench, reports[bench.name], directory)]
    return "\n".join(lines).rstrip() + "\n"


def how_fast(directory: Path = REPORT_DIR) -> str:
    """README.md's one table: what a user of each surface gains, and how much of it is our
    kernels and compiled steps (the no-draft ablation) and how much speculation, where the
    bench measured the ablation; where its benches ran on more than one machine, each row
    names its own."""
    look, chain, structured = (load(n, directory) for n in ("lookahead", "chain", "structured"))
    milvus, serve = load("ralm_milvus_300ms", directory), load("serve", directory)
    served = load("ralm_milvus_300ms_served", directory)

    def decoded(part: str) -> str:
        return (f"{_x(_system(look, part, 'rag_spec_no_drafts'))} without drafts (our kernels, "
                f"compiled steps), drafts {_x(look[part]['rag_spec_over_no_drafts'])} over that")

    apart = "not measured apart"
    # each row: what, instead of what, the speedup, of which, and the report it comes from
    rows: list[tuple[str, str, str, str, dict[str, Any]]] = [
        ("LangChain RAG chain (`SpecRetriever` + `ChatLookahead`)", "`ChatHuggingFace`",
         _x(chain["langchain"]["speedup"]), apart, chain),
        ("LlamaIndex query engine (`LookaheadLLM`)", "`HuggingFaceLLM`",
         _x(chain["llamaindex"]["speedup"]), apart, chain),
        ("`LookaheadDecoder`, RAG answers", "`generate`", _x(_system(look, "rag", "rag_spec")),
         decoded("rag"), look),
        ("`LookaheadDecoder`, open-ended answers", "`generate`",
         _x(_system(look, "open_ended", "rag_spec")), decoded("open_ended"), look),
        *_gguf_rows(look),
        ("JSON under a schema", "`generate` + xgrammar",
         _x(_system(structured, "extraction", "rag_spec", "speedup_vs_peer")),
         f"{_x(_system(structured, 'extraction', 'rag_spec_no_drafts', 'speedup_vs_peer'))} "
         f"without drafts", structured),
        ("iterative RaLM, Milvus behind 300 ms", "the naive loop",
         _x(milvus["systems"]["spec_all_lookahead"]["speedup_vs_naive"]),
         f"{_x(milvus['systems']['spec_all']['speedup_vs_naive'])} speculative retrieval "
         f"alone, lookahead decoding the rest", milvus),
        ("iterative RaLM in front of `rag-spec serve` (`ServedModel`), Milvus behind 300 ms",
         "the naive loop, same server", _x(served["systems"]["spec_all"]["speedup_vs_naive"]),
         f"{served['systems']['spec_all']['speedup_vs_naive'] / served['amdahl_bound']:.2f} "
         f"of the bound retrieval's share sets ({_x(served['amdahl_bound'])})", served),
        *_serve_rows(serve)]
    gguf = any("gguf" in look[part] for part in ("rag", "open_ended"))
    reports = (look, chain, structured, milvus, served, *(serve for _ in _serve_rows(serve)))
    machines = sorted({machine(r) for r in reports})
    several = len(machines) > 1  # then each row names its machine
    cells = [(a, b, c, f"{d} (VM {machines.index(machine(source)) + 1})" if several else d)
             for a, b, c, d, source in rows]
    if several:
        machines = [f"VM {i}: {m}" for i, m in enumerate(machines, 1)]
    wide = all("avx512f" in r.get("machine", {}).get("vector_flags", ()) for r in reports)
    needs = (f"steps {look.get('default_passes', 'compiled ahead of time')} (`make compile`)"
             + (", a CPU with AVX-512 (our linear kernel's widest path; an AVX2 CPU runs its "
                "AVX2 path, and the kernels' share differs)" if wide else ""))
    return "\n".join([
        "| what you run | instead of | speedup, same output | of which |",
        "| --- | --- | ---: | --- |",
        *(f"| {a} | {b} | {c} | {d} |" for a, b, c, d in cells), "",
        f"Measured on: {'; '.join(machines)}; SmolLM2-135M-Instruct, greedy; with {needs}. "
        "Against the transformers-based classes, on the model's float32 weights "
        "(`quantized=False`: the peers' weights, so every answer is checked against theirs)"
        + ("; against plain llama.cpp (what `ChatLlamaCpp`, `LlamaCPP` and Ollama run), on "
           "the model's GGUF file's own weights, what a CPU user gets by default (its answers "
           "are checked against our one-token decoding of the file)" if gguf else
           "; llama.cpp (`ChatLlamaCpp`, `LlamaCPP`, Ollama), the peer of the default GGUF "
           "weights, is measured below (Python)") + ". "
        "Parts are medians of per-prompt ratios, so they need not multiply to the whole. Every "
        "command, machine and per-prompt figure: [the benchmarks](docs/benchmarks/README.md)."])


def _gguf_rows(look: dict[str, Any]) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """The CPU default on a GGUF file against plain llama.cpp, where the bench ran it."""
    rows = []
    for part, label in (("rag", "RAG answers"), ("open_ended", "open-ended answers")):
        gguf = look[part].get("gguf")
        if not gguf:
            continue
        systems, n = gguf["systems"], look[part]["prompts"]
        threads = gguf["peer"].removeprefix("gguf_llama_cpp_").replace("_", " ")
        rows.append((f"`LookaheadDecoder` on the GGUF file's weights (the CPU default), {label}",
                     f"plain llama.cpp, {threads}",
                     _x(systems["gguf_rag_spec"]["speedup_vs_llama_cpp"]),
                     f"{_x(systems['gguf_rag_spec_no_drafts']['speedup_vs_llama_cpp'])} without "
                     f"drafts; answers are our one-token decoding's of the file (llama.cpp's "
                     f"own: {systems[gguf['peer']]['identical_to_no_drafts']} of {n} equal)",
                     look))
    return rows


def _serve_rows(serve: dict[str, Any]) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """The server under 8 concurrent clients against llama.cpp's, where the bench ran it."""
    peer = serve.get("llama_cpp_server")
    levels = {x["clients"]: x for x in serve["levels"]}
    if not isinstance(peer, dict) or "speedup_vs_llama_cpp" not in levels.get(8, {}):
        return []
    one, eight = levels[1], levels[8]
    return [("`rag-spec serve`, 8 concurrent clients (any OpenAI client)",
             f"llama.cpp's server (llama-cpp-python), same GGUF file, {peer['threads']} "
             f"thread{'s' * (peer['threads'] > 1)}", _x(eight["speedup_vs_llama_cpp"]),
             f"{_x(one['speedup_vs_llama_cpp'])} at one client, continuous batching "
             f"{_x(eight['speedup'])} over that; answers as alone "
             f"{eight['identical_to_alone']} of {serve['questions']}", serve)]


def with_how_fast(readme: str, table: str) -> str:
    """README.md's text with the table between its markers replaced."""
    head, found, rest = readme.partition(START)
    if not found or END not in rest:
        msg = f"README.md has no {START} ... {END} block to render the table into"
        raise ValueError(msg)
    return f"{head}{START}\n{table}\n{END}{rest.split(END, 1)[1]}"


def render(directory: Path = REPORT_DIR, readme: Path = README) -> dict[Path, str]:
    """What each generated file should hold."""
    return {directory / "README.md": page(directory),
            readme: with_how_fast(readme.read_text(), how_fast(directory))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rag_spec.bench.page", description=__doc__)
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 where a generated file is out of date")
    args = parser.parse_args(argv)
    rendered = render()
    if args.check:
        stale = [p for p, text in rendered.items() if not p.is_file() or p.read_text() != text]
        for path in stale:
            print(f"{path} is out of date: run python -m rag_spec.bench.page", file=sys.stderr)
        return 1 if stale else 0
    for path, text in rendered.items():
        path.write_text(text)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
