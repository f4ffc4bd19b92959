"""The target's linear layers from 8-bit weights on the streamed kernel: how fast would our
decoder run, against itself in float32 and against plain llama.cpp on the shipped Q4_1 file?

A measurement for the route past llama.cpp on CPUs, not a setting: the runner's stacks are
built with ``stored=torch.int8`` (the draft head's format: a scale per output) by patching
the runner's ``linear_stacks`` for one runner. Eager steps throughout (the steps compiled
ahead of time were built for float32 stacks). Per prompt, interleaved: float32 without drafts,
float32 with the default drafts (head + trie), 8-bit without drafts, 8-bit with them, and,
where llama-cpp-python is installed, plain llama.cpp greedy decoding of the GGUF file (its own
defaults: one-token steps on ``cpu_count // 2`` threads). 8-bit weights are another model: its
tokens are checked against its own decoding without drafts. Writes
lab/results/int8_target.json. ``python -m lab.int8_target``.
"""

from __future__ import annotations

from typing import Any

import torch

from lab import held_out_prompts, interleaved, write_result
from rag_spec.bench.report import command_line, machine

NEW_TOKENS = 128


def _int8_decoder(lm: Any, config: Any) -> Any:
    from dataclasses import replace

    import rag_spec.target.transformers.runner as runner_module
    from rag_spec.engine.decoder import ablated

    plain = runner_module.linear_stacks

    def narrow(root: Any, own: Any, streamed: bool = True, stored: Any = None) -> Any:
        return plain(root, own, streamed, torch.int8)

    runner_module.linear_stacks = narrow
    try:  # a settings value no other runner has, so this one is built (and kept) apart
        share = replace(config.runner).onednn_memory_share + 1e-9
        return ablated(lm.model, lm.tokenizer, config, onednn_memory_share=share)
    finally:
        runner_module.linear_stacks = plain


def main() -> dict[str, Any]:
    import rag_spec

    lm = rag_spec.load_model()
    sets = held_out_prompts(lm, 6, 6)
    eager = rag_spec.LookaheadConfig(compile=False)
    none = rag_spec.LookaheadConfig(compile=False, budget=0)
    systems: dict[str, Any] = {
        "float32_no_drafts": rag_spec.LookaheadDecoder(lm.model, lm.tokenizer, none),
        "float32": rag_spec.LookaheadDecoder(lm.model, lm.tokenizer, eager),
        "int8_no_drafts": _int8_decoder(lm, none),
        "int8": _int8_decoder(lm, eager)}
    runs: dict[str, Any] = {name: lambda p, d=d: d.generate(p, max_new_tokens=NEW_TOKENS)
                            for name, d in systems.items()}
    try:
        import llama_cpp as lib

        from lab.llamacpp_numerics import Context, _gguf
        from lab.llamacpp_trees import plain

        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.use_extra_bufts = False
        gguf = lib.llama_model_load_from_file(str(_gguf()).encode(), params)

        def llama_cpp(prompt: list[int]) -> Any:
            ctx = Context(lib, gguf, 2)
            tokens, _ = plain(ctx, prompt)
            ctx.close()
            return tokens

        runs["llama_cpp_q4_1"] = llama_cpp
    except ImportError:
        pass
    for run in runs.values():  # warm up: kernels built, caches allocated
        run(sets["rag"][0][:64])
    report: dict[str, Any] = {"benchmark": "int8_target", "command": command_line(),
                              "machine": machine(), "new_tokens": NEW_TOKENS, "passes": "eager"}
    report.update(interleaved(runs, sets, "float32_no_drafts",
                              {"float32": "float32_no_drafts", "int8": "int8_no_drafts"}))
    write_result(report, "int8_target")
    return report


if __name__ == "__main__":
    main()
