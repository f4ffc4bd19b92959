"""``python -m lab.same_decisions OLD_CHECKOUT``: whether this checkout's sizing decides what
another's does, step for step, once timing is taken out.

A step's sizing reads measured pass costs, so two runs of the same policy verify different
cuts whenever their timings differ, and an A/B's tokens per pass moves with the machine's
noise. Here every pass costs what a fixed model says (a target pass ``1 + 0.08`` per extra
token, a draft pass 0.3, a proposal its count), so the decisions are a function of the policy
and the tokens alone: each drafter's steps, drafted nodes and accepted tokens, per prompt (one
row, 4 held-out RAG and 4 held-out open-ended prompts, 64 tokens) and for a batch of the 4
RAG prompts (48 tokens), are equal in both checkouts unless a change meant to decide
otherwise. ``AB_HEAD``: a draft head file both can load.

Against the checkout before the one plan per step (lab/results/same_decisions.json): the trie,
the draft model, the early exit and self-speculation decide alike; the draft head merged with
the trie drafts a few nodes more on 4 of 8 prompts, as meant: a merged model's acceptance per
round, which sets its depth, is now learnt on the step after it drafted from all the tokens its
draft would have kept, not at its next draft from the verified ones only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

DRAFTERS = ("trie", "head_trie", "draft_model", "early_exit", "self_spec")


def worker() -> None:
    """One checkout's decisions (imports whichever rag_spec ``PYTHONPATH`` names first)."""
    from rag_spec.policy.step_costs import StepCosts

    def target(self: StepCosts, width: int, seconds: float) -> None:
        self.target[width] = 1.0 + 0.08 * (width - 1)

    def draft(self: StepCosts, seconds: float, passes: int) -> None:
        if passes:
            self.draft = 0.3

    def proposal(self: StepCosts, counted: float, seconds: float) -> None:
        if counted > 0:
            self.counted_step = 1.0

    StepCosts.record_target = target  # type: ignore[method-assign]
    StepCosts.record_draft = draft  # type: ignore[method-assign]
    StepCosts.record_proposal = proposal  # type: ignore[method-assign]

    from lab import held_out_prompts
    from rag_spec import (
        DraftModelDrafter,
        EarlyExitDrafter,
        FeatureDrafter,
        LookaheadDecoder,
        MergedDrafter,
        SelfSpecDrafter,
        TrieDrafter,
        first_layers_folder,
    )
    from rag_spec.drafters.draft_head import load_head
    from rag_spec.models import load_model

    lm = load_model("smollm2-135m-instruct")
    small = load_model(first_layers_folder(lm, 8))
    head = load_head(lm.model, Path(os.environ["AB_HEAD"]))
    prompts = held_out_prompts(lm, 4, 4)
    rag, open_ended = prompts["rag"], prompts["open_ended"]
    makers = {"trie": TrieDrafter,
              "head_trie": lambda: MergedDrafter(FeatureDrafter(head)),
              "draft_model": lambda: MergedDrafter(DraftModelDrafter(small.model)),
              "early_exit": lambda: EarlyExitDrafter(8),
              "self_spec": lambda: SelfSpecDrafter(budget=64)}

    def counts(result: object) -> list[int]:
        stats = result.stats  # type: ignore[attr-defined]
        return [stats.steps, stats.drafted, sum(stats.accepted_per_step)]

    decided = {}
    for name in DRAFTERS:
        decoder = LookaheadDecoder(lm.model, lm.tokenizer, drafter=makers[name]())
        one = [counts(decoder.generate(p, max_new_tokens=64)) for p in rag + open_ended]
        batch = [counts(r) for r in decoder.generate(rag, max_new_tokens=48)]
        decided[name] = {"one_row": one, "batch_of_4": batch}
    print(json.dumps(decided))


def main(old: str) -> None:
    here = str(Path(__file__).resolve().parents[1])
    runs = {}
    for tree, root in (("old", old), ("new", here)):
        env = dict(os.environ, PYTHONPATH=f"{root}:{root}/kernels:{here}")
        done = subprocess.run([sys.executable, __file__, "--worker"], env=env, cwd=root,
                              capture_output=True, text=True, check=True)
        runs[tree] = json.loads(done.stdout.strip().splitlines()[-1])
    report = {name: {"same": runs["old"][name] == runs["new"][name],
                     "old": runs["old"][name], "new": runs["new"][name]} for name in DRAFTERS}
    for name, row in report.items():
        print(f"{name:12s} {'same' if row['same'] else 'DIFFERENT'}")
    from lab import write_result

    write_result(report, "same_decisions")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        main(*sys.argv[1:])
