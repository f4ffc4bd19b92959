"""``rag-spec bench batch``: RAG questions answered in batches, each prompt as long as its
retrieved passages make it (the bench's RAG prompts: a question and its top 3 passages, a few
hundred tokens each, so a batch's rows are ragged).

Per batch the systems run interleaved, greedy: transformers ``generate`` on the left-padded
batch (the baseline), our decoder, our decoder drafting nothing (``rag_spec_no_drafts``: the
kernels without speculation), and our decoder prefilling every batch as one pass padded to its
longest prompt (``rag_spec_padded_prefill``: the ablation of ``prefill.length_groups``, which
prefills rows of very different lengths in groups). Every row's tokens are compared with
generate's; speedups are medians of per-batch ratios.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

from rag_spec.bench.report import (
    Run,
    dequantized,
    figure,
    interleaved,
    machine,
    median,
    padded_generate,
    publish,
    rows_run,
    rows_summary,
    save_figure,
    setting,
)


def padded_prefills() -> Any:
    """A context in which every batch is prefilled as one pass padded to its longest prompt:
    the ablation of ``prefill.length_groups`` (named here, so that a test keeps it pointing at
    the constant that groups)."""
    import rag_spec.target.transformers.prefill as prefill

    return mock.patch.object(prefill, "_PADDING_SHARE", math.inf)


def run(batch: int = 4, limit: int | None = None, max_new_tokens: int = 64,
        json_out: str | None = None, model_name: str = "smollm2-135m-instruct"
        ) -> dict[str, Any]:
    """Run the benchmark on the first ``limit`` RAG prompts in batches of ``batch``, print a
    table, write JSON and a PNG plot; return the report."""
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import RAG_QUESTIONS
    from rag_spec.engine.decoder import LookaheadDecoder
    from rag_spec.models import load_model

    lm = load_model(model_name)
    rag, _ = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], 0)
    batches = [rag[i:i + batch] for i in range(0, len(rag) - batch + 1, batch)] or [rag]

    def hf(prompts: list[list[int]]) -> Run:
        return rows_run(padded_generate(lm.model, prompts, lm.tokenizer.pad_token_id,
                                        do_sample=False, max_new_tokens=max_new_tokens))

    def ours(decoder: Any, padded_prefill: bool = False) -> Any:
        def generate(prompts: list[list[int]]) -> Run:
            with padded_prefills() if padded_prefill else nullcontext():
                results = decoder.generate(prompts, max_new_tokens=max_new_tokens)
            return rows_run([r.token_ids for r in results], {
                "stats": [r.stats for r in results],
                "prefill_seconds": results[0].stats.prefill_seconds})
        return generate

    # a decoder each: the trie's memory of one system's answers must not draft for another
    systems = {"hf": hf, "rag_spec": ours(LookaheadDecoder(lm.model, lm.tokenizer, dequantized())),
               "rag_spec_no_drafts": ours(LookaheadDecoder(lm.model, lm.tokenizer,
                                                           dequantized(budget=0))),
               "rag_spec_padded_prefill": ours(LookaheadDecoder(lm.model, lm.tokenizer,
                                                                dequantized()),
                                               padded_prefill=True)}
    for system in systems.values():  # warm up: runners built, kernels primed
        system([p[:48] for p in batches[0]])
    print(f"batch {batch}: {len(batches)} batches of prompts of {min(map(len, rag))}-"
          f"{max(map(len, rag))} tokens")
    report: dict[str, Any] = {"benchmark": "batch", "model": model_name, "dtype": str(lm.dtype),
                              "batch": batch, "max_new_tokens": max_new_tokens,
                              "machine": machine(),
                              **rows_summary(interleaved(systems, batches), check=True)}
    for ablation in ("no_drafts", "padded_prefill"):  # what drafts and grouped prefills buy
        report[f"rag_spec_over_{ablation}"] = round(median([a / b for a, b in zip(
            *(report["systems"][name]["per_prompt_speedup"]
              for name in ("rag_spec", f"rag_spec_{ablation}")))]), 3)
    publish(report, json_out, "batch", _plot, _print_table)
    return report


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, ax = figure(1, (7, 5))
    data = report["systems"]
    ax.boxplot([s["per_prompt_speedup"] for s in data.values()], tick_labels=list(data))
    ax.axhline(1.0, color="grey", lw=0.8, ls="--")
    ax.tick_params(axis="x", rotation=30)
    ax.set_ylabel("speedup vs transformers on the padded batch")
    save_figure(fig, path, f"{setting(report)}, {report['prompts']} batches of "
                           f"{report['batch']}, {report['max_new_tokens']} new tokens")


def _print_table(report: dict[str, Any]) -> None:
    print(f"\n{report['prompts']} batches of {report['batch']} RAG prompts: rag_spec "
          f"{report['rag_spec_over_no_drafts']:.2f}x itself without drafts, "
          f"{report['rag_spec_over_padded_prefill']:.2f}x itself with padded prefills")
    print(f"{'system':24} {'tok/s':>7} {'vs hf':>7} {'prefill':>8} {'identical':>10}")
    for system, s in report["systems"].items():
        prefill = f"{s['prefill_seconds']:.2f}s" if "prefill_seconds" in s else "-"
        print(f"{system:24} {s['tok_per_s']:7.1f} {s['speedup_vs_hf']:6.2f}x {prefill:>8} "
              f"{s['identical_to_hf']:>5}/{report['prompts']}")
