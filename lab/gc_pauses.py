"""``python -m lab.gc_pauses``: how long Python's garbage collections pause decoding, with and
without ``gc.freeze()`` after loading (docs/troubleshooting.md, "A long-running service
pauses"). Each mode runs in a process of its own (freezing is process-wide and one-way): the
embedded model and the default decoder loaded, then the lookahead bench's RAG and open-ended
prompts answered, with ``gc.callbacks`` timing every collection by generation. Environment:
``GP_LIMIT`` prompts per set (default 8), ``GP_N`` new tokens (128); writes
lab/results/gc_pauses.json and .png.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from lab import RESULTS

MODES = ("as loaded", "frozen after loading")


def main() -> None:
    from rag_spec.bench.report import figure, machine, publish, save_figure, setting

    runs = {mode: json.loads(subprocess.run(
        [sys.executable, "-m", "lab.gc_pauses", mode], capture_output=True, text=True,
        check=True).stdout.strip().splitlines()[-1]) for mode in MODES}
    report = {"benchmark": "gc_pauses", "model": "smollm2-135m-instruct", "dtype": "float32",
              "machine": machine(), "runs": runs}

    def plot(report: dict[str, Any], path: Path) -> None:
        fig, axis = figure(1, (7, 3.5))
        modes = list(report["runs"])
        axis.bar(modes, [report["runs"][m]["longest_ms"] for m in modes])
        axis.set_ylabel("longest collection during decoding (ms)")
        save_figure(fig, path, f"{setting(report)}: garbage-collection pauses")

    def table(report: dict[str, Any]) -> None:
        for mode, run in report["runs"].items():
            print(f"{mode}: {run['tracked_objects']} tracked, {run['steps']} steps, "
                  f"longest collection {run['longest_ms']} ms, full ones {run['full']}")

    publish(report, None, "gc_pauses", plot, table, RESULTS)


def _measure(mode: str) -> dict[str, Any]:
    """One process's collections while it decodes (printed as one JSON line)."""
    from rag_spec import LookaheadDecoder
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import RAG_QUESTIONS
    from rag_spec.models import load_model

    limit, n = int(os.environ.get("GP_LIMIT", 8)), int(os.environ.get("GP_N", 128))
    lm = load_model("smollm2-135m-instruct")
    rag, open_ended = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit)
    decoder = LookaheadDecoder(lm.model, lm.tokenizer)
    decoder.generate(rag[0], 16)  # first use: kernels prepared
    tracked = len(gc.get_objects())  # what a full collection walks, unless frozen
    if mode == MODES[1]:
        gc.freeze()
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def timed(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    gc.callbacks.append(timed)
    steps = sum(decoder.generate(p, n).stats.steps for p in rag + open_ended)
    gc.callbacks.remove(timed)
    gc.unfreeze()
    return {"tracked_objects": tracked, "prompts": len(rag + open_ended), "steps": steps,
            "collections": len(pauses),
            "full": [round(1000 * s, 1) for g, s in pauses if g == 2],
            "longest_ms": round(1000 * max((s for _, s in pauses), default=0.0), 1),
            "ms_per_step": round(1000 * sum(s for _, s in pauses) / steps, 3)}


if __name__ == "__main__":
    if sys.argv[1:]:
        print(json.dumps(_measure(sys.argv[1])))
    else:
        main()
