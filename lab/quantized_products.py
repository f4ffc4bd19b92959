"""The embedded model's decoder-layer products on rag-spec's streamed kernel with float32,
float16 and 8-bit weights, by rows: what a one-token step and a tree step would read and cost
if the target's weights were stored narrower (the draft head's already are).

One step's products in layer order, weights pushed out of cache first (a 400 MB sweep),
medians of 9, on both cores. Writes lab/results/quantized_products.json.
``python -m lab.quantized_products``.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from lab import write_result
from rag_spec.bench.report import command_line, machine
from rag_spec_kernels.streamed import (
    pack_streamed,
    quantized,
    streamed_available,
    streamed_linear,
)

ROWS = (1, 5, 9, 13, 17)


def main() -> dict[str, Any]:
    import rag_spec

    lm = rag_spec.load_model()
    if not streamed_available(torch.float32):
        msg = "the streamed kernel does not run on this CPU"
        raise SystemExit(msg)
    layers = [m for m in lm.model.model.layers.modules() if isinstance(m, torch.nn.Linear)]
    eights = [quantized(layer.weight) for layer in layers]
    packs = {"float32": [(pack_streamed(m.weight), None) for m in layers],
             "float16": [(pack_streamed(m.weight, torch.float16), None) for m in layers],
             "int8": [(pack_streamed(w), scale) for w, scale in eights]}
    sweep = torch.empty(100_000_000)
    generator = torch.Generator().manual_seed(0)
    report: dict[str, Any] = {"benchmark": "quantized_products", "command": command_line(),
                              "machine": machine(), "model": lm.name, "weights": {}}
    for name, packed in packs.items():
        ms = {}
        for rows in ROWS:
            inputs = {m.in_features: torch.randn(rows, m.in_features, generator=generator)
                      for m in layers}
            times = []
            for _ in range(9):
                sweep.add_(1)
                started = time.perf_counter()
                for (weight, scale), m in zip(packed, layers):
                    streamed_linear(inputs[m.in_features], weight, m.out_features, scale=scale)
                times.append(time.perf_counter() - started)
            ms[str(rows)] = round(statistics.median(times) * 1000, 2)
        megabytes = sum(w.numel() * w.element_size() for w, _ in packed) / 1e6
        report["weights"][name] = {"mb": round(megabytes, 1), "ms_by_rows": ms}
        print(name, report["weights"][name], flush=True)
    write_result(report, "quantized_products")
    return report


if __name__ == "__main__":
    main()
