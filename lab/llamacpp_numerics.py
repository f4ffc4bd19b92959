"""When does a llama.cpp batch give each of its tokens the logits a one-token step gives?

The question behind verifying token trees on llama.cpp losslessly. Greedy one-token decoding
of RAG prompts (a held-out question and its top-3 passages) on the embedded Q4_1 GGUF, flash
attention on, with ``n_threads`` 1 and 2 for one-token steps (batches on every core); then each
continuation re-evaluated in chunks of 4 tokens after the prompt (what a verification step
computes), each position's logits compared bit for bit with the one-token step's, split by the
KV cells a step reads (llama.cpp pads them to 256: under 512, or 512 and more). Writes
lab/results/llamacpp_numerics.json.

Needs llama-cpp-python (not a rag-spec dependency: ``pip install llama-cpp-python``, which
compiles llama.cpp) and the GGUF file (``LCPP_GGUF``, default: extracted from the embedded
model's wheel into rag-spec's cache). ``python -m lab.llamacpp_numerics``.
"""

from __future__ import annotations

import multiprocessing
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


class Context:
    """A llama.cpp context whose sequence 0 is the answer and 1..n the branches of a tree."""

    def __init__(self, lib: Any, model: Any, seqs: int, threads: int | None = None) -> None:
        self.lib = lib
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = 4096, 512, 512
        params.n_seq_max, params.kv_unified = seqs, True
        # one-token steps' threads: llama-cpp-python's default unless given
        params.n_threads = threads or max(multiprocessing.cpu_count() // 2, 1)
        params.n_threads_batch = multiprocessing.cpu_count()
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self.ctx = lib.llama_init_from_model(model, params)
        self.memory = lib.llama_get_memory(self.ctx)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.batch = lib.llama_batch_init(512, 0, seqs)

    def decode(self, tokens: list[int], positions: list[int], seqs: list[list[int]],
               outputs: list[bool]) -> np.ndarray:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, (token, pos, ids, out) in enumerate(zip(tokens, positions, seqs, outputs)):
            b.token[i], b.pos[i], b.logits[i], b.n_seq_id[i] = token, pos, out, len(ids)
            for j, s in enumerate(ids):
                b.seq_id[i][j] = s
        if self.lib.llama_decode(self.ctx, b) != 0:
            msg = "llama_decode failed"
            raise RuntimeError(msg)
        rows = [i for i, out in enumerate(outputs) if out]
        return np.stack([np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, i),
                                               shape=(self.vocab,)) for i in rows])

    def prefill(self, prompt: list[int]) -> np.ndarray:
        """The prompt as sequence 0, in ``n_batch`` chunks; the logits after its last token."""
        for start in range(0, len(prompt), 512):
            chunk = prompt[start:start + 512]
            last = [i == len(chunk) - 1 for i in range(len(chunk))]
            logits = self.decode(chunk, list(range(start, start + len(chunk))),
                                 [[0]] * len(chunk), last)
        return logits[-1]

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def greedy(lib: Any, model: Any, prompt: list[int], threads: int
           ) -> tuple[list[int], list[np.ndarray]]:
    ctx = Context(lib, model, 1, threads)
    logits = [ctx.prefill(prompt)]
    tokens = [int(logits[0].argmax())]
    while len(tokens) < NEW_TOKENS:
        at = len(prompt) + len(tokens) - 1
        logits.append(ctx.decode([tokens[-1]], [at], [[0]], [True])[0])
        tokens.append(int(logits[-1].argmax()))
    ctx.close()
    return tokens, logits


def chunked(lib: Any, model: Any, prompt: list[int], tokens: list[int], threads: int
            ) -> list[np.ndarray]:
    """The logits after each of ``tokens`` (and after the prompt), the continuation fed in
    chunks of ``CHUNK``: position i's logits come from a batch, as a verified tree's do."""
    ctx = Context(lib, model, 1, threads)
    logits = [ctx.prefill(prompt)]
    fed = tokens[:-1]
    for start in range(0, len(fed), CHUNK):
        chunk = fed[start:start + CHUNK]
        at = len(prompt) + start
        logits += list(ctx.decode(chunk, list(range(at, at + len(chunk))), [[0]] * len(chunk),
                                  [True] * len(chunk)))
    ctx.close()
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
              "n_threads_batch": multiprocessing.cpu_count(), "prompts": rows}
    write_result(report, "llamacpp_numerics")
    return report


if __name__ == "__main__":
    main()
