"""The embedded model decoded from its GGUF file's own quantised weights
(``LookaheadConfig(quantized=True)``), against the float32 de-quantised weights and against
plain llama.cpp on the same file: is the quantised target what a CPU user should get?

Per prompt, interleaved: float32 without drafts and with the default drafts (head + trie),
the file's weights without drafts and with them, and where llama-cpp-python is installed plain
llama.cpp greedy decoding of the same file at 1 and 2 one-token threads (repacked / AMX weights
off: they crash on the Xeon VMs). Each setting's steps compiled ahead of time (run
``rag-spec models compile`` and ``decoder.package_steps()`` first; the report says how passes
ran). The quantised weights are another model than float32: their drafted output is checked
against their own decoding without drafts; how often it also equals llama.cpp's is reported for
information. Writes lab/results/gguf_target.json. ``python -m lab.gguf_target [RAG OPEN]``.
"""

from __future__ import annotations

import sys
from typing import Any

from lab import held_out_prompts, interleaved, write_result
from rag_spec.bench.report import command_line, machine

NEW_TOKENS = 128


def _llama_cpp(path: str, eos: int) -> dict[str, Any]:
    """Plain llama.cpp greedy decoding of ``path`` at 1 and 2 threads, if installed (its
    answer cut after ``eos``, where ours stop)."""
    try:
        import llama_cpp as lib
    except ImportError:
        print("llama-cpp-python is not installed: llama.cpp is left out", flush=True)
        return {}
    from lab.llamacpp_numerics import Context
    from lab.llamacpp_trees import plain

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.use_extra_bufts = False
    model = lib.llama_model_load_from_file(path.encode(), params)

    def run(threads: int) -> Any:
        def decode(prompt: list[int]) -> list[int]:
            ctx = Context(lib, model, 1, threads)
            tokens, _ = plain(ctx, prompt)
            ctx.close()
            return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens
        return decode

    return {"llama_cpp_1_thread": run(1), "llama_cpp_2_threads": run(2)}


def main(rag: int = 8, open_ended: int = 4) -> dict[str, Any]:
    import rag_spec
    from rag_spec.target.gguf import source_file

    lm = rag_spec.load_model()
    sets = held_out_prompts(lm, rag, open_ended)
    config = rag_spec.LookaheadConfig
    decoders = {"float32_no_drafts": config(budget=0, quantized=False),
                "float32": config(quantized=False),
                "gguf_no_drafts": config(budget=0, quantized=True),
                "gguf": config(quantized=True)}
    passes = {}
    runs: dict[str, Any] = {}
    for name, settings in decoders.items():
        decoder = rag_spec.LookaheadDecoder(lm.model, lm.tokenizer, settings)
        passes[name] = decoder.generate(sets["rag"][0][:64], max_new_tokens=4).stats.passes
        runs[name] = lambda p, d=decoder: d.generate(p, max_new_tokens=NEW_TOKENS)
    runs.update(_llama_cpp(str(source_file(lm.model)), lm.tokenizer.eos_token_id))
    for run in runs.values():  # warm up: kernels built, caches allocated
        run(sets["rag"][0][:64])
    report: dict[str, Any] = {"benchmark": "gguf_target", "command": command_line(),
                              "machine": machine(), "new_tokens": NEW_TOKENS, "passes": passes,
                              "file": source_file(lm.model).name}
    references = {"float32": "float32_no_drafts", "gguf": "gguf_no_drafts"}
    references.update({name: "gguf_no_drafts" for name in runs if name.startswith("llama")})
    report.update(interleaved(runs, sets, "float32_no_drafts", references,
                              peers=("llama_cpp_1_thread", "llama_cpp_2_threads")))
    write_result(report, "gguf_target")
    return report


if __name__ == "__main__":
    main(*map(int, sys.argv[1:3]))
