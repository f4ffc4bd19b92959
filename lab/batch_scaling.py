"""How far batching can raise a server's aggregate speed on this machine: held-out RAG prompts
decoded one at a time and in batches of 8 that start together (the best case for any
scheduler: no joins, no HTTP), with and without drafts, on the GGUF file's weights (the CPU
default) and on float32. ``rag-spec serve`` at 8 clients cannot beat the batch's ratio over
one prompt at a time by much; this is the bound ``rag-spec bench serve``'s 8-client goal meets.
A prompt's prefill is one compute-bound pass whether or not others decode beside it, so the
share of one-at-a-time time spent in prefill bounds what any batching gains (Amdahl:
``prefill_bound``, were batched decoding free).

Two rounds, each system's rounds interleaved with the others'; medians of the rounds.
Writes lab/results/batch_scaling.json. ``python -m lab.batch_scaling [PROMPTS]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from lab import held_out_prompts, write_result
from rag_spec.bench.report import command_line, machine

NEW_TOKENS = 64
ROWS = 8
ROUNDS = 2


def main(count: int = 16) -> dict[str, Any]:
    import rag_spec

    lm = rag_spec.load_model()
    prompts = held_out_prompts(lm, count, 0)["rag"]
    config = rag_spec.LookaheadConfig
    systems = {"gguf": config(), "gguf_no_drafts": config(budget=0),
               "float32": config(quantized=False),
               "float32_no_drafts": config(quantized=False, budget=0)}
    decoders = {name: rag_spec.LookaheadDecoder(lm.model, lm.tokenizer, c)
                for name, c in systems.items()}
    for decoder in decoders.values():
        decoder.generate(prompts[0], 16)  # first-use costs off the clock
    rates: dict[str, dict[str, list[float]]] = {
        n: {"alone": [], "batch": [], "prefill_share": []} for n in systems}
    for _ in range(ROUNDS):
        for name, decoder in decoders.items():
            started = time.perf_counter()
            results = [decoder.generate(p, NEW_TOKENS) for p in prompts]
            seconds = time.perf_counter() - started
            rates[name]["alone"].append(sum(len(r.token_ids) for r in results) / seconds)
            rates[name]["prefill_share"].append(
                sum(r.stats.prefill_seconds for r in results) / seconds)
            started = time.perf_counter()
            tokens = sum(len(r.token_ids) for at in range(0, len(prompts), ROWS)
                         for r in decoder.generate(prompts[at:at + ROWS], NEW_TOKENS))
            rates[name]["batch"].append(tokens / (time.perf_counter() - started))
    report: dict[str, Any] = {"command": command_line(), "machine": machine(),
                              "prompts": len(prompts), "new_tokens": NEW_TOKENS, "rows": ROWS,
                              "systems": {}}
    best_alone = max(statistics.median(r["alone"]) for r in rates.values())
    for name, r in rates.items():
        alone, batch = statistics.median(r["alone"]), statistics.median(r["batch"])
        share = statistics.median(r["prefill_share"])
        report["systems"][name] = {
            "alone_tok_per_s": round(alone, 1), "batch_tok_per_s": round(batch, 1),
            "batch_over_alone": round(batch / alone, 2),
            "batch_over_best_alone": round(batch / best_alone, 2),
            "prefill_share_alone": round(share, 3), "prefill_bound": round(1 / share, 2)}
        print(f"{name:>18}: alone {alone:6.1f} tok/s, batches of {ROWS} {batch:6.1f} tok/s "
              f"({batch / alone:.2f}x; {batch / best_alone:.2f}x the fastest alone); prefill "
              f"{share:.0%} of the time alone, so batching gains {1 / share:.2f}x at most",
              flush=True)
    write_result(report, "batch_scaling")
    return report


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:2]))
