"""``python -m lab.head_sizes [RUNS]``: how many nodes the default decoder (draft head + trie)
verifies on repeated prompts, run after run, in fresh processes one after another.

The sizer reads measured pass costs, and a steady drafter carries them from one generation to
the next, so one noisy estimate can hold a size for the rest of a process: this shows whether
runs settle on the same size. Each run decodes the 6 held-out open-ended prompts twice (96
tokens; the second time the trie copies earlier answers) and reports tokens per pass per
prompt and the sizes the sizer chose over the last prompt (lab/results/head_sizes.json).
"""

from __future__ import annotations

import collections
import json
import subprocess
import sys


def run() -> dict:
    """One process's run (imports this checkout's rag_spec)."""
    from lab import held_out_prompts
    from rag_spec import FeatureDrafter, LookaheadDecoder, MergedDrafter
    from rag_spec.models import load_model
    from rag_spec.policy import budget

    chosen: list[int] = []
    size = budget.TreeSizer.size

    def recorded(self: budget.TreeSizer, *args: object) -> tuple[int, bool]:
        cut = size(self, *args)  # type: ignore[arg-type]
        chosen.append(cut[0])
        return cut

    budget.TreeSizer.size = recorded  # type: ignore[method-assign]
    lm = load_model("smollm2-135m-instruct")
    decoder = LookaheadDecoder(lm.model, lm.tokenizer,
                               drafter=MergedDrafter(FeatureDrafter.trained(lm.model)))
    prompts = held_out_prompts(lm, 1, 6)
    decoder.generate(prompts["rag"][0][:64], 96)  # warm-up
    per_pass = []
    for prompt in prompts["open_ended"] * 2:
        chosen.clear()
        per_pass.append(round(decoder.generate(prompt, 96).stats.tokens_per_step, 2))
    return {"tokens_per_pass": per_pass,
            "mean": round(sum(per_pass) / len(per_pass), 3),
            "last_prompt_sizes": dict(sorted(collections.Counter(chosen).items()))}


def main(runs: int = 3) -> None:
    reports = []
    for _ in range(runs):
        done = subprocess.run([sys.executable, "-m", "lab.head_sizes", "--run"],
                              capture_output=True, text=True, check=True)
        reports.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(reports[-1], flush=True)
    from lab import write_result

    write_result({"runs": reports}, "head_sizes")


if __name__ == "__main__":
    if sys.argv[1:] == ["--run"]:
        print(json.dumps(run()))
    else:
        main(*map(int, sys.argv[1:]))
