"""What a llama.cpp step costs by its width: the bound on any tree verified on its kernels.

A verified tree of w - 1 drafts gains at most (tokens kept per pass) / (cost of a w-token step
over a one-token step). Medians of 15 steps after a 300-token context, one-token steps on both
cores, for each GGUF file given, with and without llama.cpp's repacked weights
(``use_extra_bufts``: interleaved Q4_0 / Q4_K layouts with batched kernels; on the AMX Xeon
their path crashes on batches). Writes lab/results/llamacpp_step_costs.json.

The 1B file of the run in lab/results: a random Llama-3.2-1B-shaped model (SmolLM2's
vocabulary) saved by transformers, converted by llama.cpp's ``convert_hf_to_gguf.py --outtype
f16`` and quantised by ``llama_cpp.llama_model_quantize`` (Q4_1, Q4_0, Q8_0, Q4_K_M).
``python -m lab.llamacpp_step_costs FILE.gguf ...``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from lab import write_result
from lab.llamacpp_numerics import Context
from lab.llamacpp_trees import step_ms
from rag_spec.bench.report import command_line, machine


def main(paths: list[str]) -> dict[str, Any]:
    import llama_cpp as lib

    lib.llama_backend_init()
    report: dict[str, Any] = {"benchmark": "llamacpp_step_costs", "command": command_line(),
                              "llama_cpp_python": lib.__version__, "machine": machine(),
                              "context": 300, "threads": 2, "files": {}}
    for path in paths:
        for repacked in (False, True):
            params = lib.llama_model_default_params()
            params.use_extra_bufts = repacked
            model = lib.llama_model_load_from_file(path.encode(), params)
            ctx = Context(lib, model, 2)
            lib.llama_set_n_threads(ctx.ctx, 2, 2)
            ms = step_ms(ctx)
            ctx.close()
            lib.llama_model_free(model)
            name = f"{Path(path).stem}{' repacked' if repacked else ''}"
            report["files"][name] = {"step_ms": ms, "over_one_token": {
                w: round(v / ms["1"], 2) for w, v in ms.items()}}
            print(name, report["files"][name], flush=True)
    write_result(report, "llamacpp_step_costs")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
