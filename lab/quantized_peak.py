"""How close the quantised kernel's wide steps come to this CPU's integer dot-product rate: the
bound on a tree step over a GGUF file's weights once the weights are read.

On one thread, weights in cache (a 512 x 2048 layer, each format), the kernel's multiply-adds
per second by rows (``quantized_linear``); beside them the rate of VNNI's ``vpdpbusd`` alone,
on 256- and 512-bit registers (24 independent sums, no loads), where the CPU has AVX-512
VNNI. A 13-row step of a model whose products need more than twice this rate (two cores) over
their one-token step's time cannot reach a given ratio to it, whatever the kernel does.
Writes lab/results/quantized_peak.json. ``python -m lab.quantized_peak``.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lab import write_result
from rag_spec.bench.report import command_line, machine
from rag_spec_kernels import GroupQuantized, pack_quantized, quantized_available, quantized_linear
from rag_spec_kernels.cpu_extension import vector_flags

OUT, IN = 512, 2048
ROWS = (1, 4, 8, 13, 16)

_PEAK = r"""
#include <immintrin.h>
#include <chrono>
#include <cstdio>

template <class V, V (*DOT)(V, V, V)>
double per_second(long rounds) {  // multiply-adds a second, 24 sums side by side
  V sums[24], a = V(), b = V();
  for (auto& s : sums) s = V();
  asm volatile("" : "+x"(a), "+x"(b));  // not constants: the products are computed
  const auto start = std::chrono::steady_clock::now();
  for (long k = 0; k < rounds; ++k)
    for (auto& s : sums) s = DOT(s, a, b);
  const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
  for (auto& s : sums) asm volatile("" : : "x"(s));
  return 24.0 * rounds * sizeof(V) / took.count();  // a byte pair is one multiply-add
}

__m256i dot256(__m256i s, __m256i a, __m256i b) { return _mm256_dpbusd_epi32(s, a, b); }
__m512i dot512(__m512i s, __m512i a, __m512i b) { return _mm512_dpbusd_epi32(s, a, b); }

int main() {
  std::printf("%f %f\n", per_second<__m256i, dot256>(20000000),
              per_second<__m512i, dot512>(20000000));
}
"""


def _weight(kind: str, generator: torch.Generator) -> GroupQuantized:
    scales = torch.rand(OUT, IN // 32, generator=generator).half()
    if kind == "Q8_0":
        values = torch.randint(-128, 128, (OUT, IN), generator=generator, dtype=torch.int8)
        return GroupQuantized(values, scales, None, 8)
    values = torch.randint(0, 16, (OUT, IN), generator=generator, dtype=torch.uint8)
    mins = torch.randn(OUT, IN // 32, generator=generator).half() if kind == "Q4_1" else None
    return GroupQuantized(values, scales, mins, 4)


def kernel_rates() -> dict[str, dict[str, float]]:
    """GMAC/s of ``quantized_linear`` by format and rows: the best of 7 runs of 50 products."""
    generator = torch.Generator().manual_seed(0)
    rates: dict[str, dict[str, float]] = {}
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        packed = pack_quantized(_weight(kind, generator))
        rates[kind] = {}
        for rows in ROWS:
            x = torch.randn(rows, IN, generator=generator)
            best = float("inf")
            for _ in range(7):
                started = time.perf_counter()
                for _ in range(50):
                    quantized_linear(x, packed, OUT)
                best = min(best, (time.perf_counter() - started) / 50)
            rates[kind][str(rows)] = round(rows * OUT * IN / best / 1e9, 1)
    return rates


def vnni_rates() -> dict[str, float] | None:
    """GMAC/s of ``vpdpbusd`` alone, 256 and 512 bits wide (a program built with the C++
    compiler, -O3 as the kernels); None without AVX-512 VNNI."""
    if "avx512_vnni" not in vector_flags():
        return None
    with tempfile.TemporaryDirectory() as folder:
        source, program = Path(folder) / "peak.cpp", Path(folder) / "peak"
        source.write_text(_PEAK)
        subprocess.run(["c++", "-O3", "-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512vnni",
                        str(source), "-o", str(program)], check=True)
        out = subprocess.run([str(program)], check=True, capture_output=True, text=True)
    narrow, wide = map(float, out.stdout.split())
    return {"vpdpbusd_256": round(narrow / 1e9, 1), "vpdpbusd_512": round(wide / 1e9, 1)}


def main() -> dict[str, Any]:
    if not quantized_available():
        msg = "the quantised kernel does not run on this CPU"
        raise SystemExit(msg)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report: dict[str, Any] = {"benchmark": "quantized_peak", "command": command_line(),
                                  "machine": machine(), "threads": 1, "layer": [OUT, IN],
                                  "kernel_gmac_per_s": kernel_rates(),
                                  "instruction_gmac_per_s": vnni_rates()}
    finally:
        torch.set_num_threads(threads)
    print(report, flush=True)
    write_result(report, "quantized_peak")
    return report


if __name__ == "__main__":
    main()
