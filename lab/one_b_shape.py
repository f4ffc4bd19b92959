"""The bandwidth argument at the size users run: a Llama-3.2-1B-shaped GGUF file with random
weights, and what a step of each width costs on it, ours (the file's blocks on our kernels)
and llama.cpp's.

The file: Llama-3.2-1B's shape (2048 wide, 16 blocks, 8192 feed-forward, 32 heads over 8 KV
heads, tied embeddings) with SmolLM2's vocabulary and tokenizer (copied from the embedded
model's file, so transformers' GGUF loader reads it), every matrix in one block format
written by gguf-py (``gguf.quants``), norms float32. Random weights make answers meaningless
but step costs real: what a step reads and multiplies depends on shapes and formats only.

Reported, after a 300-token context (medians of 9 steps; ours eager, a root plus a chain):
our step and llama.cpp's (2 threads, repacked weights off) at widths 1, 2, 4, 8, 13 and 16,
each over its own one-token step; our one-token step over llama.cpp's; and no-draft tok/s
(64 tokens after the same prompt) for ours and for llama.cpp at 1 and 2 threads. The issue's
goals: our one-token step <= 1.1x llama.cpp's, our 13-row step <= 1.6x our one-token step.
Q4_K_M (what most users' files are: Q4_K matrices, Q6_K for half the value and down
projections) is quantised from the Q8_0 file by llama.cpp's own quantiser
(``llama_model_quantize``), gguf-py having none for the K-quants.
Writes lab/results/one_b_shape_<format>.json.
``python -m lab.one_b_shape [Q4_0|Q4_1|Q8_0|Q4_K_M] [FOLDER]`` (the file is written once into
FOLDER, default /tmp).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lab import write_result
from rag_spec.bench.report import command_line, machine

SHAPE = {"embedding_length": 2048, "block_count": 16, "feed_forward_length": 8192,
         "attention.head_count": 32, "attention.head_count_kv": 8, "context_length": 8192,
         "rope.freq_base": 500000.0, "attention.layer_norm_rms_epsilon": 1e-5,
         "rope.dimension_count": 64}
WIDTHS = (1, 2, 4, 8, 13, 16)
CONTEXT = 300
NEW_TOKENS = 64


def write_file(path: Path, kind: str) -> Path:
    """The 1B-shaped file in block format ``kind`` at ``path`` (kept if already there)."""
    import gguf

    import rag_spec
    from rag_spec.target.gguf import source_file

    if path.is_file():
        return path
    if kind == "Q4_K_M":
        return _requantized(write_file(path.with_name(path.name.replace(kind, "Q8_0")),
                                       "Q8_0"), path)
    qtype = gguf.GGMLQuantizationType[kind]
    source = gguf.GGUFReader(str(source_file(rag_spec.load_model().model)))
    writer = gguf.GGUFWriter(str(path) + ".part", "llama")
    writer.add_name(f"random Llama-3.2-1B shape, {kind}")
    for key, value in SHAPE.items():
        kind_of = (gguf.GGUFValueType.FLOAT32 if isinstance(value, float)
                   else gguf.GGUFValueType.UINT32)
        writer.add_key_value(f"llama.{key}", value, kind_of)
    vocab = int(source.fields["llama.vocab_size"].contents())
    writer.add_vocab_size(vocab)
    for key, field in source.fields.items():  # the tokenizer, as the embedded model's
        if key.startswith("tokenizer."):
            types = field.types
            writer.add_key_value(key, field.contents(), types[0],
                                 types[-1] if types[0] == gguf.GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(0)
    hidden, ffn = SHAPE["embedding_length"], SHAPE["feed_forward_length"]
    kv = hidden // SHAPE["attention.head_count"] * SHAPE["attention.head_count_kv"]

    def matrix(name: str, rows: int, cols: int) -> None:
        weight = rng.standard_normal((rows, cols), dtype=np.float32) * 0.02
        writer.add_tensor(name, gguf.quants.quantize(weight, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        writer.add_tensor(name, np.ones(hidden, dtype=np.float32))

    matrix("token_embd.weight", vocab, hidden)
    for block in range(SHAPE["block_count"]):
        print(f"writing block {block + 1} of {SHAPE['block_count']}", flush=True)
        prefix = f"blk.{block}"
        norm(f"{prefix}.attn_norm.weight")
        matrix(f"{prefix}.attn_q.weight", hidden, hidden)
        matrix(f"{prefix}.attn_k.weight", kv, hidden)
        matrix(f"{prefix}.attn_v.weight", kv, hidden)
        matrix(f"{prefix}.attn_output.weight", hidden, hidden)
        norm(f"{prefix}.ffn_norm.weight")
        matrix(f"{prefix}.ffn_gate.weight", ffn, hidden)
        matrix(f"{prefix}.ffn_up.weight", ffn, hidden)
        matrix(f"{prefix}.ffn_down.weight", hidden, ffn)
    norm("output_norm.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    Path(str(path) + ".part").rename(path)
    return path


def _requantized(source: Path, path: Path) -> Path:
    """``source`` quantised to Q4_K_M at ``path`` by llama.cpp."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    part = Path(str(path) + ".part")
    if llama_cpp.llama_model_quantize(str(source).encode(), str(part).encode(), params) != 0:
        msg = f"llama.cpp could not quantise {source} to Q4_K_M"
        raise RuntimeError(msg)
    part.rename(path)
    return path


def ours(path: Path, prompt: list[int]) -> dict[str, Any]:
    """Our step costs by width and no-draft tok/s on the file's blocks (eager steps: no
    package is compiled for this shape)."""
    import rag_spec
    from lab.floor import runner_step_seconds
    from rag_spec.target.transformers.runner import RunnerSettings

    lm = rag_spec.load_model(str(path))
    settings = RunnerSettings(quantized=True)
    seconds = runner_step_seconds(lm.model, prompt, WIDTHS, settings=settings)
    decoder = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer,
                                        rag_spec.LookaheadConfig(budget=0, quantized=True))
    decoder.generate(prompt, max_new_tokens=4)  # warm-up
    started = time.perf_counter()
    result = decoder.generate(prompt, max_new_tokens=NEW_TOKENS)
    return {"step_ms": {str(w): round(s * 1000, 2) for w, s in seconds.items()},
            "no_draft_tok_per_s": round(len(result.token_ids)
                                        / (time.perf_counter() - started), 1),
            "passes": result.stats.passes}


def llama_cpp(path: Path, prompt: list[int]) -> dict[str, Any] | None:
    """llama.cpp's step costs by width (2 threads) and plain greedy tok/s at 1 and 2 threads;
    None where llama-cpp-python is not installed."""
    try:
        import llama_cpp as lib
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp is left out", flush=True)
        return None
    from lab.llamacpp_numerics import Context
    from lab.llamacpp_trees import step_ms

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.use_extra_bufts = False  # repacked / AMX weights crash on the Xeon VMs
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    ctx = Context(lib, model, 1, 2)
    report: dict[str, Any] = {"llama_cpp_python": lib.__version__,
                              "step_ms": step_ms(ctx, CONTEXT, WIDTHS)}
    ctx.close()
    for threads in (1, 2):
        ctx = Context(lib, model, 1, threads)
        ctx.prefill(prompt[:8])  # warm-up
        ctx.lib.llama_memory_seq_rm(ctx.memory, 0, 0, -1)
        started = time.perf_counter()
        out = [int(ctx.prefill(prompt).argmax())]
        while len(out) < NEW_TOKENS:
            at = len(prompt) + len(out) - 1
            out.append(int(ctx.decode([out[-1]], [at], [[0]], [True])[0].argmax()))
        report[f"no_draft_tok_per_s_{threads}_threads"] = round(
            len(out) / (time.perf_counter() - started), 1)
        ctx.close()
    lib.llama_model_free(model)
    return report


def main(kind: str = "Q4_0", folder: str = "/tmp") -> dict[str, Any]:
    path = write_file(Path(folder) / f"random-llama-3.2-1b-shape.{kind}.gguf", kind)
    prompt = list(range(1000, 1000 + CONTEXT))
    report: dict[str, Any] = {"benchmark": "one_b_shape", "command": command_line(),
                              "machine": machine(), "format": kind, "context": CONTEXT,
                              "new_tokens": NEW_TOKENS, "file_bytes": path.stat().st_size}
    peer = llama_cpp(path, prompt)  # first: ours then holds the model's float32 copy too
    report["ours"] = ours(path, prompt)
    mine = report["ours"]["step_ms"]
    report["ours"]["over_one_token"] = {w: round(v / mine["1"], 2) for w, v in mine.items()}
    if peer is not None:
        theirs = peer["step_ms"]
        peer["over_one_token"] = {w: round(v / theirs["1"], 2) for w, v in theirs.items()}
        report["llama_cpp"] = peer
        report["ours_over_llama_cpp"] = {w: round(mine[w] / theirs[w], 2) for w in mine}
        best = max(peer["no_draft_tok_per_s_1_threads"], peer["no_draft_tok_per_s_2_threads"])
        report["no_draft_speedup_vs_llama_cpp"] = round(
            report["ours"]["no_draft_tok_per_s"] / best, 3)
    report["goals"] = {"one_token_step_over_llama_cpp": report.get(
        "ours_over_llama_cpp", {}).get("1"), "13_rows_over_one_token": report["ours"][
        "over_one_token"]["13"]}
    print(report, flush=True)
    write_result(report, f"one_b_shape_{kind.lower()}")
    return report


if __name__ == "__main__":
    main(*sys.argv[1:3])
