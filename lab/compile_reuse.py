"""``python -m lab.compile_reuse MODE``: what a fresh process pays to compile the default
decoder's steps (``LookaheadConfig(compile=True)``, ``warm_up()``), by what it can reuse.

Modes, each in its own process with ``TORCHINDUCTOR_CACHE_DIR`` set by the caller: ``save``
(nothing cached: compiles, then saves torch's portable cache artifacts to ``ARTIFACTS``),
``load`` (an empty inductor cache, the saved artifacts loaded first:
``torch.compiler.load_cache_artifacts``), ``local`` (inductor's disk cache as ``save`` left it).
Prints the warm-up's seconds and the first two answers' (64 tokens).
"""

from __future__ import annotations

import sys
import time

ARTIFACTS = "/tmp/rag_spec_compile_artifacts.bin"


def main(mode: str) -> None:
    import torch

    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.models import load_model
    from rag_spec.prompts import chat_input_ids

    lm = load_model("smollm2-135m-instruct")
    if mode == "load":
        started = time.perf_counter()
        with open(ARTIFACTS, "rb") as file:
            torch.compiler.load_cache_artifacts(file.read())
        print("load_artifacts_s", round(time.perf_counter() - started, 2))
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(compile=True, exact=False))
    print(mode, "warm_up_s", round(decoder.warm_up(progress=False), 2), flush=True)
    if mode == "save":
        saved = torch.compiler.save_cache_artifacts()
        if saved:
            with open(ARTIFACTS, "wb") as file:
                file.write(saved[0])
            print("artifacts_mb", round(len(saved[0]) / 2**20, 1))
    prompt = chat_input_ids(lm.tokenizer, [{"role": "user", "content": "Explain recursion."}])
    for which in ("first", "second"):
        started = time.perf_counter()
        decoder.generate(prompt, max_new_tokens=64)
        print(f"{which}_answer_s", round(time.perf_counter() - started, 2))


if __name__ == "__main__":
    main(sys.argv[1])
