"""``python -m lab.ab_trees OLD_CHECKOUT``: the decoder of another checkout against this one's,
interleaved on the same prompts in two persistent processes (the redesign's speed check).

Rows: no drafts, the trie, the draft head merged with the trie (``AB_HEAD``: a head file
both checkouts can load; the default drafter), a draft model (the model's first 8 layers as a
model of its own) merged with the trie, an early exit (8 layers), and self-speculation
(256 KV entries). Prompt sets, all of held-out questions and prompts: RAG answers, open-ended
answers, and ``long`` (RAG prompts of about 2,048 tokens, for self-speculation). Per prompt
set, the median of per-prompt time ratios new/old, each tree against ``generate``, tokens per
pass, and whether every output is ``generate``'s. Environment: ``AB_LIMIT`` prompts per set
(default 6), ``AB_N`` new tokens (96), ``AB_OUT`` the JSON report, ``AB_ROWS`` / ``AB_SETS``
some rows / prompt sets only (comma-separated; default: the first three rows on the first two
sets), ``AB_REPEAT`` each prompt set that many times over (a row's noise shrinks).

``python -m lab.ab_trees OLD_CHECKOUT --decisions``: whether this checkout's sizing decides
what another's does, step for step, once timing is taken out. A step's sizing reads measured
pass costs, so two runs of the same policy verify different cuts whenever their timings
differ, and an A/B's tokens per pass moves with the machine's noise. Here every pass costs
what a fixed model says, so the decisions are a function of the policy and the tokens alone:
each drafter's steps, drafted nodes and accepted tokens, per prompt (one row, 4 held-out RAG
and 4 held-out open-ended prompts, 64 tokens) and for a batch of the 4 RAG prompts (48
tokens), are equal in both checkouts unless a change meant to decide otherwise. Against the
checkout before the one plan per step (lab/results/same_decisions.json) every drafter decides
alike but the draft head merged with the trie, which drafts a few nodes more on 4 of 8
prompts, as meant: a merged model's acceptance per round, which sets its depth, is now learnt
on the step after it drafted from all the tokens its draft would have kept, not at its next
draft from the verified ones only (with that rule patched back on a scratch copy, the head's
decisions were the old tree's too).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROWS = ("no_drafts", "trie", "head_trie")
SETS = ("rag", "open_ended")
DECIDING = ("trie", "head_trie", "draft_model", "early_exit", "self_spec")


def drafters(lm: Any, self_budget: int = 256) -> dict[str, Callable[[], Any]]:
    """How each row's drafter is made, in whichever checkout is imported: the trie, a draft
    model (the model's first 8 layers) merged with the trie, an early exit (8 layers),
    self-speculation (``self_budget`` KV entries) and, given ``AB_HEAD``, the draft head
    merged with the trie."""
    from rag_spec import (
        DraftModelDrafter,
        EarlyExitDrafter,
        FeatureDrafter,
        MergedDrafter,
        SelfSpecDrafter,
        TrieDrafter,
        first_layers_folder,
    )
    from rag_spec.drafters.draft_head import load_head
    from rag_spec.models import load_model

    small = load_model(first_layers_folder(lm, 8))
    makers: dict[str, Callable[[], Any]] = {
        "trie": TrieDrafter,
        "draft_model": lambda: MergedDrafter(DraftModelDrafter(small.model)),
        "early_exit": lambda: EarlyExitDrafter(8),
        "self_spec": lambda: SelfSpecDrafter(budget=self_budget)}
    if os.environ.get("AB_HEAD"):
        head = load_head(lm.model, Path(os.environ["AB_HEAD"]))
        makers["head_trie"] = lambda: MergedDrafter(FeatureDrafter(head))
    return makers


def worker() -> None:
    """One checkout's decoders, answering JSON jobs from stdin (imports whichever rag_spec
    ``PYTHONPATH`` names first)."""
    import torch

    import rag_spec
    from rag_spec import LookaheadConfig, LookaheadDecoder, TrieDrafter
    from rag_spec.models import load_model

    lm = load_model("smollm2-135m-instruct")
    decoders = {"no_drafts": LookaheadDecoder(lm.model, lm.tokenizer,
                                              LookaheadConfig(budget=0), drafter=TrieDrafter())}
    decoders.update({name: LookaheadDecoder(lm.model, lm.tokenizer, drafter=make())
                     for name, make in drafters(lm).items()})
    print(json.dumps({"ready": rag_spec.__file__}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        started = time.perf_counter()
        if job["system"] == "hf":
            ids = torch.tensor([job["prompt"]])
            out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=job["n"])
            tokens, per_pass = out[0, ids.shape[1]:].tolist(), 1.0
        else:
            result = decoders[job["system"]].generate(job["prompt"], max_new_tokens=job["n"])
            tokens, per_pass = result.token_ids, result.stats.tokens_per_step
        print(json.dumps({"tokens": tokens, "seconds": time.perf_counter() - started,
                          "per_pass": per_pass}), flush=True)


def decisions_worker() -> None:
    """One checkout's sizing decisions on a fixed cost model (``--decisions``): every pass
    costs what the model says (a target pass ``1 + 0.08`` per extra token, a draft pass 0.3,
    a proposal its count), whatever it took."""
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
    from rag_spec import LookaheadDecoder
    from rag_spec.models import load_model

    lm = load_model("smollm2-135m-instruct")
    makers = drafters(lm, self_budget=64)  # short prompts: the sparse view must start
    prompts = held_out_prompts(lm, 4, 4)
    rag, open_ended = prompts["rag"], prompts["open_ended"]

    def counts(result: Any) -> list[int]:
        stats = result.stats
        return [stats.steps, stats.drafted, sum(stats.accepted_per_step)]

    decided = {}
    for name in DECIDING:
        decoder = LookaheadDecoder(lm.model, lm.tokenizer, drafter=makers[name]())
        one = [counts(decoder.generate(p, max_new_tokens=64)) for p in rag + open_ended]
        batch = [counts(r) for r in decoder.generate(rag, max_new_tokens=48)]
        decided[name] = {"one_row": one, "batch_of_4": batch}
    print(json.dumps(decided))


def decisions(old: str) -> None:
    """Whether this checkout's sizing decides what ``old``'s does, step for step, once timing
    is taken out (``--decisions``, module docstring)."""
    here = str(Path(__file__).resolve().parents[1])
    runs = {}
    for tree, root in (("old", old), ("new", here)):
        env = dict(os.environ, PYTHONPATH=f"{root}:{root}/kernels:{here}")
        done = subprocess.run([sys.executable, __file__, "--decisions-worker"], env=env,
                              cwd=root, capture_output=True, text=True, check=True)
        runs[tree] = json.loads(done.stdout.strip().splitlines()[-1])
    report = {name: {"same": runs["old"][name] == runs["new"][name],
                     "old": runs["old"][name], "new": runs["new"][name]} for name in DECIDING}
    for name, row in report.items():
        print(f"{name:12s} {'same' if row['same'] else 'DIFFERENT'}")
    from lab import write_result

    write_result(report, "same_decisions")


def main(old: str) -> None:
    from lab import held_out_prompts
    from rag_spec.bench.longctx import long_prompts
    from rag_spec.bench.prompts import HELD_OUT_RAG_QUESTIONS
    from rag_spec.models import load_model

    limit, n = int(os.environ.get("AB_LIMIT", 6)), int(os.environ.get("AB_N", 96))
    lm = load_model("smollm2-135m-instruct")
    held_out = held_out_prompts(lm, limit, limit)
    rag, open_ended = held_out["rag"], held_out["open_ended"]
    sets = os.environ.get("AB_SETS", ",".join(SETS)).split(",")
    long = long_prompts(lm.tokenizer, limit, [2048], HELD_OUT_RAG_QUESTIONS)[2048] \
        if "long" in sets else []
    here = str(Path(__file__).resolve().parents[1])
    procs = {}
    for tree, root in (("old", old), ("new", here)):
        env = dict(os.environ, PYTHONPATH=f"{root}:{root}/kernels:{here}")
        # run as a script from the checkout: ``-m`` would put this checkout first on the path
        procs[tree] = subprocess.Popen([sys.executable, __file__, "--worker"],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env=env, cwd=root)
        print(tree, procs[tree].stdout.readline().strip(), file=sys.stderr)
    rows = [r for r in os.environ.get("AB_ROWS", ",".join(ROWS)).split(",")
            if r != "head_trie" or os.environ.get("AB_HEAD")]
    repeat = int(os.environ.get("AB_REPEAT", 1))
    systems = [("new", "hf")] + [(tree, row) for row in rows for tree in ("old", "new")]

    def ask(tree: str, system: str, prompt: list[int]) -> dict:
        proc = procs[tree]
        proc.stdin.write(json.dumps({"system": system, "prompt": prompt, "n": n}) + "\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())

    for tree, system in systems:
        ask(tree, system, rag[0][:64])  # warm-up
    report = {}
    for name, prompts in (("rag", rag * repeat), ("open_ended", open_ended * repeat),
                          ("long", long * repeat)):
        if name not in sets:
            continue
        runs: dict[tuple[str, str], list[dict]] = {s: [] for s in systems}
        for i, prompt in enumerate(prompts):
            for s in systems[i % len(systems):] + systems[:i % len(systems)]:
                runs[s].append(ask(*s, prompt))
        hf = runs[("new", "hf")]
        report[name] = {row: {
            "new_over_old": round(statistics.median(
                o["seconds"] / w["seconds"] for o, w in zip(runs[("old", row)],
                                                            runs[("new", row)])), 3),
            **{f"{tree}_vs_generate": round(statistics.median(
                h["seconds"] / r["seconds"] for h, r in zip(hf, runs[(tree, row)])), 3)
               for tree in ("old", "new")},
            **{f"{tree}_tokens_per_pass": round(statistics.mean(
                r["per_pass"] for r in runs[(tree, row)]), 3) for tree in ("old", "new")},
            "identical_to_generate": sum(o["tokens"] == h["tokens"] == w["tokens"] for o, w, h in
                                         zip(runs[("old", row)], runs[("new", row)], hf)),
            "prompts": len(prompts)} for row in rows}
        print(name, json.dumps(report[name], indent=1), flush=True)
    from lab import RESULTS  # here: a worker runs under the other checkout's lab package

    out = Path(os.environ.get("AB_OUT", RESULTS / "ab_trees.json"))
    out.write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))


def plot(report: dict, path: Path) -> None:
    """Each row's new/old ratio per prompt set, beside the 0.97 a change must keep (the
    redesign's bar)."""
    from rag_spec.bench.report import figure, save_figure

    fig, axes = figure(len(report), (5 * len(report), 4), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], report.items()):
        ax.bar(list(rows), [r["new_over_old"] for r in rows.values()])
        ax.axhline(0.97, color="red", lw=0.8, ls="--")
        ax.set_title(f"{name}: {next(iter(rows.values()))['prompts']} prompts")
        ax.set_ylabel("new / old speed (median of per-prompt ratios)")
    save_figure(fig, path, "this checkout against another")


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    elif sys.argv[1:] == ["--decisions-worker"]:
        decisions_worker()
    elif sys.argv[2:] == ["--decisions"]:
        decisions(sys.argv[1])
    else:
        main(*sys.argv[1:])
