"""``rag-spec bench longctx``: long-context RAG served in batches (MagicDec's regime).

Each prompt is a question plus as many top-ranked passages of the default corpus as fit the
context length, so rows are ragged. Per (batch, context) the systems run interleaved, greedy:
transformers ``generate`` on the left-padded batch (the baseline), our decoder drafting nothing
(``rag_spec_no_drafts``: the same kernels without speculation), our decoder with
``SelfSpecDrafter`` (a StreamingLLM view of its own cache), and with the trie. Decoding is timed
apart from the prefill (ours: the decoder's own prefill time; generate: from its first token),
every row's tokens are compared with generate's, and the self-drafter's measured step costs,
acceptance and chosen draft lengths are reported. The ``_sdpa`` systems are the kernel's
ablation: the same decoder, without and with self-drafts, attending through SDPA's flash kernel
instead of ours (``ablated(..., cpu_attention=False)``), so the kernel's gain and
speculation's are told apart.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from rag_spec.bench.prompts import RAG_QUESTIONS
from rag_spec.bench.report import (
    dequantized,
    figure,
    machine,
    median,
    padded_generate,
    pass_statistics,
    peak_rss_mb,
    publish,
    reset_peak_rss,
    save_figure,
    setting,
)

SYSTEMS = ("hf", "rag_spec_no_drafts", "rag_spec_self_spec", "rag_spec_trie",
           "rag_spec_no_drafts_sdpa", "rag_spec_self_spec_sdpa")


def run(batches: Sequence[int] = (1, 4, 8, 16), contexts: Sequence[int] = (1024, 2048, 4096),
        max_new_tokens: int = 64, budget: int = 256, json_out: str | None = None,
        model_name: str = "smollm2-135m-instruct") -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON and a PNG plot; return the report."""
    from rag_spec.drafters.self_drafter import SelfSpecDrafter
    from rag_spec.engine.decoder import LookaheadDecoder, ablated
    from rag_spec.models import load_model

    lm = load_model(model_name)
    drafter, drafter_sdpa = SelfSpecDrafter(budget=budget), SelfSpecDrafter(budget=budget)
    decoders = {"rag_spec_no_drafts": LookaheadDecoder(lm.model, lm.tokenizer,
                                                       dequantized(budget=0)),
                "rag_spec_self_spec": LookaheadDecoder(lm.model, lm.tokenizer, dequantized(),
                                                       drafter=drafter),
                "rag_spec_trie": LookaheadDecoder(lm.model, lm.tokenizer,
                                                  dequantized(memory_mb=0)),
                "rag_spec_no_drafts_sdpa": ablated(lm.model, lm.tokenizer,
                                                   dequantized(budget=0), cpu_attention=False),
                "rag_spec_self_spec_sdpa": ablated(lm.model, lm.tokenizer, dequantized(),
                                                   drafter=drafter_sdpa, cpu_attention=False)}
    report: dict[str, Any] = {"benchmark": "longctx", "model": model_name,
                              "dtype": str(lm.dtype), "max_new_tokens": max_new_tokens,
                              "self_spec_budget": budget, "machine": machine(), "runs": []}
    prompts = long_prompts(lm.tokenizer, max(batches), contexts)
    warm = [p[-96:] for p in prompts[contexts[0]][:max(batches)]]  # kernels primed per shape
    _hf(lm, warm, 8)
    for decoder in decoders.values():
        _ours(decoder, warm, 8)
    for context in contexts:
        for batch in batches:
            rows = prompts[context][:batch]
            print(f"batch {batch} x context {context} (prompts of {min(map(len, rows))}-"
                  f"{max(map(len, rows))} tokens)")
            order = SYSTEMS[len(report["runs"]) % len(SYSTEMS):] + \
                SYSTEMS[:len(report["runs"]) % len(SYSTEMS)]  # rotated per configuration
            results = {}
            for name in order:
                if name == "hf":
                    results[name] = _hf(lm, rows, max_new_tokens)
                else:
                    results[name] = _ours(decoders[name], rows, max_new_tokens)
                print(f"  {name}: {results[name]['decode_tokens_per_second']:.1f} tok/s "
                      f"(prefill {results[name]['prefill_seconds']:.1f} s)")
            report["runs"].append({**_summary(batch, context, results, drafter, drafter_sdpa),
                                   "step_ms": step_ms(lm.model, rows)})
    publish(report, json_out, "longctx", _plot, _print_table)
    return report


def step_ms(model: Any, prompts: list[list[int]], widths: Sequence[int] = (1, 2, 4, 8),
            repeats: int = 5) -> dict[str, dict[int, float]]:
    """Median milliseconds of one pass over each row's root plus a chain of ``width - 1``
    tokens, on our CPU attention kernel (``ours``) and on SDPA (``sdpa``) in turn, over one
    prefill of ``prompts`` (each pass's entries dropped): what the kernel saves per step, and
    what a wider verification costs against a one-token step (the first round is not timed)."""
    import torch

    from rag_spec.target.transformers.prefill import prefill
    from rag_spec.target.transformers.runner import Runner
    from rag_spec.target.transformers.step_inputs import tree_step
    from rag_spec.target.tree import TokenTree

    runners = {"ours": Runner.of(model, dequantized().runner),
               "sdpa": Runner.of(model, replace(dequantized().runner, cpu_attention=False))}
    timings: dict[tuple[str, int], list[float]] = {}
    with torch.inference_mode():
        cache = prefill(runners["ours"], prompts)
        for repeat in range(repeats + 1):
            for width in widths:
                chain = TokenTree.from_paths([range(3, 2 + width)])
                for name, runner in runners.items():
                    batch = tree_step(cache, [chain] * len(prompts), runner.dtype)
                    started = time.perf_counter()
                    runner.forward(cache, batch)
                    elapsed = time.perf_counter() - started
                    cache.discard_round()
                    if repeat:
                        timings.setdefault((name, width), []).append(elapsed)
    return {name: {w: round(1e3 * median(timings[name, w]), 1) for w in widths}
            for name in runners}


def long_prompts(tokenizer: Any, count: int, contexts: Sequence[int],
                 questions: Sequence[str] = RAG_QUESTIONS) -> dict[int, list[list[int]]]:
    """``count`` RAG prompts per context length, of the first of ``questions``: a question and
    the most top-ranked passages that keep it within the length."""
    from rag_spec.prompts import chat_input_ids, rag_messages
    from rag_spec.retrieval import KnowledgeBase

    questions = [questions[i % len(questions)] for i in range(count)]
    hits = KnowledgeBase.load_default("flat").search(questions, k=200)
    prompts: dict[int, list[list[int]]] = {}
    for context in contexts:
        prompts[context] = []
        for question, found in zip(questions, hits):
            low, high = 0, len(found)  # most passages that fit, by bisection
            while low < high:
                middle = (low + high + 1) // 2
                fits = len(chat_input_ids(tokenizer, rag_messages(question, found[:middle])))
                low, high = (middle, high) if fits <= context else (low, middle - 1)
            prompts[context].append(chat_input_ids(tokenizer, rag_messages(question,
                                                                           found[:low])))
    return prompts


class _FirstToken:
    """A transformers streamer that notes when the first new tokens arrive (the prefill's end:
    generate's first ``put`` is the prompt, its second the first new tokens)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first = time.perf_counter()

    def end(self) -> None:
        pass


def _hf(lm: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    reset_peak_rss()
    streamer = _FirstToken()
    started = time.perf_counter()
    rows = padded_generate(lm.model, prompts, lm.tokenizer.pad_token_id, streamer=streamer,
                           max_new_tokens=max_new_tokens, do_sample=False)
    ended = time.perf_counter()
    first = streamer.first or ended
    decoded = sum(len(r) - 1 for r in rows)  # tokens after the first, while decoding
    return {"rows": rows, "prefill_seconds": first - started,
            "decode_tokens_per_second": decoded / max(ended - first, 1e-9),
            "peak_rss_mb": round(peak_rss_mb())}


def _ours(decoder: Any, prompts: list[list[int]], max_new_tokens: int) -> dict[str, Any]:
    reset_peak_rss()
    started = time.perf_counter()
    results = decoder.generate(prompts, max_new_tokens=max_new_tokens)
    elapsed = time.perf_counter() - started
    prefill = results[0].stats.prefill_seconds
    rows = [r.token_ids for r in results]
    return {"rows": rows, "prefill_seconds": prefill,
            "decode_tokens_per_second": sum(map(len, rows)) / max(elapsed - prefill, 1e-9),
            **pass_statistics([r.stats for r in results]),
            "peak_rss_mb": round(peak_rss_mb())}


def _summary(batch: int, context: int, results: dict[str, dict[str, Any]], drafter: Any,
             drafter_sdpa: Any) -> dict[str, Any]:
    expected = results["hf"]["rows"]
    systems = {}
    for name in SYSTEMS:
        result = dict(results[name])
        rows = result.pop("rows")
        identical = sum(r == e for r, e in zip(rows, expected))
        systems[name] = {**{k: round(v, 3) if isinstance(v, float) else v
                            for k, v in result.items()},
                         "identical_rows": f"{identical}/{len(rows)}"}
    rate = {name: s["decode_tokens_per_second"] for name, s in systems.items()}
    return {"batch": batch, "context": context, "systems": systems,
            "self_spec_over_no_drafts": round(rate["rag_spec_self_spec"]
                                              / rate["rag_spec_no_drafts"], 3),
            "self_spec_over_hf": round(rate["rag_spec_self_spec"] / rate["hf"], 3),
            "no_drafts_over_hf": round(rate["rag_spec_no_drafts"] / rate["hf"], 3),
            "trie_over_no_drafts": round(rate["rag_spec_trie"] / rate["rag_spec_no_drafts"], 3),
            "kernel_over_sdpa": round(rate["rag_spec_no_drafts"]
                                      / rate["rag_spec_no_drafts_sdpa"], 3),
            "self_spec_over_no_drafts_sdpa": round(rate["rag_spec_self_spec_sdpa"]
                                                   / rate["rag_spec_no_drafts_sdpa"], 3),
            "self_spec": drafter.last.as_dict() if drafter.last is not None else None,
            "self_spec_sdpa": (drafter_sdpa.last.as_dict() if drafter_sdpa.last is not None
                               else None)}


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, axes = figure(ncols=3, size=(15, 4))
    panels = (
        ((("self_spec_over_no_drafts", " our attention"),
          ("self_spec_over_no_drafts_sdpa", " SDPA attention")),
         "self-spec / the same decoder without drafts (speculation)"),
        ((("kernel_over_sdpa", ""),), "ours / SDPA attention, no drafts (the kernel)"),
        ((("self_spec_over_hf", ""),), "self-spec / transformers generate (everything)"))
    for ax, (lines, title) in zip(axes, panels):
        for context in sorted({r["context"] for r in report["runs"]}):
            runs = sorted((r for r in report["runs"] if r["context"] == context),
                          key=lambda r: r["batch"])
            for (key, name), style in zip(lines, ("-", "--")):
                ax.plot([r["batch"] for r in runs], [r[key] for r in runs], style, marker="o",
                        label=f"{context} tokens{name}")
        ax.axhline(1.0, color="grey", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("decode speedup")
        ax.set_title(title, fontsize=10)
        ax.legend(title="context")
    save_figure(fig, path, f"Long-context batches, greedy: {setting(report)}")


def _print_table(report: dict[str, Any]) -> None:
    print(f"{'batch':>5} {'context':>7} {'hf tok/s':>9} {'no drafts':>9} {'self-spec':>9} "
          f"{'trie':>7} {'self/no':>7} {'self/hf':>7} {'tok/step':>8} {'ours/sdpa':>9} "
          f"{'sdpa self/no':>12} identical")
    for r in report["runs"]:
        s = r["systems"]
        print(f"{r['batch']:>5} {r['context']:>7} "
              f"{s['hf']['decode_tokens_per_second']:>9.1f} "
              f"{s['rag_spec_no_drafts']['decode_tokens_per_second']:>9.1f} "
              f"{s['rag_spec_self_spec']['decode_tokens_per_second']:>9.1f} "
              f"{s['rag_spec_trie']['decode_tokens_per_second']:>7.1f} "
              f"{r['self_spec_over_no_drafts']:>6.2f}x {r['self_spec_over_hf']:>6.2f}x "
              f"{s['rag_spec_self_spec']['tokens_per_step']:>8.2f} "
              f"{r['kernel_over_sdpa']:>8.2f}x {r['self_spec_over_no_drafts_sdpa']:>11.2f}x "
              + " ".join(s[n]["identical_rows"] for n in SYSTEMS[1:]))
    for r in report["runs"]:
        print(f"step ms at batch {r['batch']} x {r['context']} (tokens per row: ms): "
              + "; ".join(f"{name} " + ", ".join(f"{w}: {ms}" for w, ms in costs.items())
                          for name, costs in r["step_ms"].items()))
