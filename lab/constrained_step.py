"""``python -m lab.constrained_step``: what a grammar adds to a step. Our decoder without drafts
(one token a pass, so a pass is a step) on the structured bench's extraction prompts, with and
without the ``ApiRecord`` schema, interleaved; milliseconds per token, medians over prompts.
The constrained answer differs from the free one, so tokens are timed, not answers compared.
Environment: ``CS_LIMIT`` prompts (default 6), ``CS_N`` new tokens (96)."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

from lab import RESULTS
from rag_spec.bench.report import figure, machine, publish, save_figure, setting


def main() -> None:
    from rag_spec import KnowledgeBase, LookaheadConfig, LookaheadDecoder
    from rag_spec.bench.prompts import RAG_QUESTIONS
    from rag_spec.bench.structured import ApiRecord
    from rag_spec.models import load_model
    from rag_spec.prompts import chat_input_ids

    limit, n = int(os.environ.get("CS_LIMIT", 6)), int(os.environ.get("CS_N", 96))
    lm = load_model("smollm2-135m-instruct")
    questions = RAG_QUESTIONS[12:12 + limit]
    hits = KnowledgeBase.load_default("flat").search(questions, k=2)
    prompts = [chat_input_ids(lm.tokenizer, [{"role": "user", "content": (
        "Passages:\n" + "\n\n".join(h.text for h in found)
        + f"\n\nQuestion: {q}\nGive the API as JSON.")}]) for q, found in zip(questions, hits)]
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0))
    kinds = {"free": {}, "json_schema": {"json_schema": ApiRecord}}
    for kwargs in kinds.values():  # first use (the grammar's compiling) off the clock
        decoder.generate(prompts[0], max_new_tokens=8, **kwargs)
    ms: dict[str, list[float]] = {kind: [] for kind in kinds}
    for i, prompt in enumerate(prompts):
        for kind in (list(kinds) if i % 2 == 0 else list(kinds)[::-1]):
            started = time.perf_counter()
            result = decoder.generate(prompt, max_new_tokens=n, **kinds[kind])
            ms[kind].append(1000 * (time.perf_counter() - started) / len(result.token_ids))
    ratio = statistics.median(c / f for c, f in zip(ms["json_schema"], ms["free"]))
    report = {"benchmark": "constrained_step", "model": "smollm2-135m-instruct",
              "dtype": "float32", "machine": machine(), "max_new_tokens": n,
              "ms_per_token": {k: round(statistics.median(v), 1) for k, v in ms.items()},
              "constrained_over_free": round(ratio, 3), "prompts": len(prompts),
              "per_prompt": {k: [round(x, 1) for x in v] for k, v in ms.items()}}
    publish(report, None, "constrained_step", _plot, lambda r: print(json.dumps(r)), RESULTS)


def _plot(report: dict, path: Path) -> None:
    fig, ax = figure(1, (6, 4))
    ax.boxplot(list(report["per_prompt"].values()), tick_labels=list(report["per_prompt"]))
    ax.set_ylabel("ms per token, no drafts (per prompt)")
    save_figure(fig, path, f"{setting(report)}: constrained / free "
                           f"{report['constrained_over_free']:.3f}x")


if __name__ == "__main__":
    main()
