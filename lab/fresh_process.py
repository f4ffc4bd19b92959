"""``python -m lab.fresh_process [trie]``: a fresh process's one-time costs with the default
decoder (head + trie; ``trie``: the trie alone; its steps compiled ahead of time where
this machine holds them: ``rag-spec models compile``): importing, loading the model, building
the decoder (runner, package and head lookup and load), then two answers to different prompts
(64 tokens): the first answer's extra over the second is what first use costs."""

from __future__ import annotations

import json
import sys
import time


def main(drafts: str = "default") -> None:
    started = time.perf_counter()
    from rag_spec import LookaheadDecoder, TrieDrafter
    from rag_spec.models import load_model
    from rag_spec.prompts import chat_input_ids

    imported = time.perf_counter()
    lm = load_model("smollm2-135m-instruct")
    loaded = time.perf_counter()
    extra = {"drafter": TrieDrafter()} if drafts == "trie" else {}
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, **extra)
    built = time.perf_counter()
    step = decoder.runner.compiled
    report = {"drafts": decoder.drafter.label, "passes": "eager" if step is None else step.kind,
              "import_s": round(imported - started, 2),
              "load_model_s": round(loaded - imported, 2),
              "decoder_s": round(built - loaded, 2)}
    for which, question in (("first", "Explain recursion."), ("second", "Explain a hash table.")):
        prompt = chat_input_ids(lm.tokenizer, [{"role": "user", "content": question}])
        begun = time.perf_counter()
        result = decoder.generate(prompt, max_new_tokens=64)
        seconds = time.perf_counter() - begun
        report[f"{which}_answer_s"] = round(seconds, 2)
        report[f"{which}_tok_per_s"] = round(len(result.token_ids) / seconds, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
