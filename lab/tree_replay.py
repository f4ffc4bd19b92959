"""``python -m lab.tree_replay``: how the merged drafter's ranking rules would have cut its trees.

Records, per step of the default drafter (head + trie) at a fixed 16-node budget on the
lookahead bench's prompts, what ``MergedDrafter`` merged (the head's guesses, the trie's copies,
the copies after the guesses); then replays each rule on those inputs, cutting the ranked tree
to 4, 8 and 16 nodes, and scores the cut against the answer the decoder committed: tokens per
pass as each rule would have made them, on the same steps (a cut that accepts more would have
moved later steps, so this ranks rules; the decoder measures them: ``lab.step_profile``), beside
the ceiling no ranking passes: every drafted node verified.
Rules: copies at a constant chance (0.45, then 0.7 of the parent's a depth) over a guess's
draft probability; the same with copies also scored by how often their tokens followed; and the
default (a token both drafted ranks by both chances, a copy that has held grows likelier).
Environment: ``TR_LIMIT`` prompts per set (default 8), ``TR_N`` new tokens (128),
``TR_HELD_OUT=1`` prompts the constants were not fitted on (the bench's next RAG questions, the
open-ended prompts below); writes docs/benchmarks/tree_replay[_held_out].json and .png.

``TR_TRUSTS=1,0.3,0.1`` instead decodes (no replay: each setting's own steps) at the same fixed
16 nodes, the fitted and the held-out prompts, with each ``RECALLED_TRUST`` listed and with no
memory of earlier answers: tokens per pass, medians over prompts and pooled; writes
docs/benchmarks/memory_trust.json and .png.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

CUTS = (4, 8, 16)
CEILING = "every drafted node, uncut (the ceiling)"


def main() -> None:
    if os.environ.get("TR_TRUSTS"):
        trust_sweep([float(t) for t in os.environ["TR_TRUSTS"].split(",")])
        return
    import rag_spec.drafters.merged_drafter as merged
    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, HELD_OUT_RAG_QUESTIONS, RAG_QUESTIONS
    from rag_spec.bench.report import figure, machine
    from rag_spec.models import load_model

    limit, n = int(os.environ.get("TR_LIMIT", 8)), int(os.environ.get("TR_N", 128))
    held_out = os.environ.get("TR_HELD_OUT") == "1"
    lm = load_model("smollm2-135m-instruct")
    rag, open_ended = (prompt_sets(lm.tokenizer, HELD_OUT_RAG_QUESTIONS[:limit], limit,
                                   HELD_OUT_OPEN_PROMPTS) if held_out
                       else prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit))
    steps: list[dict[str, Any]] = []
    merge = merged._merged

    def recording(guess: Any, copies: Any, grafts: Any, budget: int) -> Any:
        steps.append({"guess": guess, "copies": copies, "grafts": grafts})
        return merge(guess, copies, grafts, budget)

    merged._merged = recording  # this process's decoder only: a lab run, not the library's use
    decoder = LookaheadDecoder(lm.model, lm.tokenizer,
                               LookaheadConfig(budget=16, adaptive=False, compile=False))
    followed, chances = merged._followed, merged._chances
    rules = {"constant chances": (lambda prefix, copies: dict.fromkeys(
                 followed(prefix, copies), 1.0), _chances_before),
             "scored by how often copies followed": (followed, _chances_before),
             "+ both drafters' chances, held copies likelier (default)": (followed, chances)}
    report: dict[str, Any] = {"benchmark": "tree_replay", "model": "smollm2-135m-instruct",
                              "machine": machine(), "max_new_tokens": n, "budget": 16,
                              "held_out": held_out}
    for name, prompts in (("rag", rag), ("open_ended", open_ended)):
        recorded = []
        for prompt in prompts:
            steps.clear()
            result = decoder.generate(prompt, max_new_tokens=n)
            answer = result.token_ids
            # each merge's row context ended where the answer so far did: replay in order
            contexts = _step_starts(result)
            assert len(contexts) == len(steps), "a step merged no drafts: the replay misaligns"
            recorded.append((answer, list(zip(contexts, steps))))
        report[name] = {}
        for rule, (merged._followed, merged._chances) in rules.items():
            report[name][rule] = {str(cut): round(statistics.median(
                statistics.mean(1 + len(merge(s["guess"], s["copies"], s["grafts"], cut)
                                          .follow(answer[start:])) for start, s in row)
                for answer, row in recorded), 3) for cut in CUTS}
        merged._followed, merged._chances = followed, chances
        # the ceiling no ranking can pass: every node the drafters proposed, uncut
        report[name][CEILING] = round(statistics.median(statistics.mean(
            1 + len(merge(s["guess"], s["copies"], s["grafts"], 10**6).follow(answer[start:]))
            for start, s in row) for answer, row in recorded), 3)
        print(name, report[name], flush=True)
    out = Path(f"docs/benchmarks/tree_replay{'_held_out' if held_out else ''}.json")
    out.write_text(json.dumps(report, indent=1))
    fig, axes = figure(2, (10, 4), sharey=True)
    for ax, name in zip(axes, ("rag", "open_ended")):
        for rule in rules:
            ax.plot(CUTS, [report[name][rule][str(c)] for c in CUTS], marker="o", label=rule)
        ax.axhline(report[name][CEILING], color="k", lw=0.8, ls="--", label=CEILING)
    _save_panels(fig, axes, out, "nodes verified (a cut of the ranked tree)",
                 "tokens per pass, replayed", "merged trees by ranking rule")


def trust_sweep(trusts: list[float]) -> None:
    """Tokens per pass at a fixed 16 nodes for each memory trust, and with no memory."""
    import rag_spec.drafters.trie_drafter as trie_drafter
    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, HELD_OUT_RAG_QUESTIONS, RAG_QUESTIONS
    from rag_spec.bench.report import figure, machine, pass_statistics
    from rag_spec.models import load_model

    limit, n = int(os.environ.get("TR_LIMIT", 8)), int(os.environ.get("TR_N", 128))
    lm = load_model("smollm2-135m-instruct")
    sets = {"": prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit),
            "held_out_": prompt_sets(lm.tokenizer, HELD_OUT_RAG_QUESTIONS[:limit], limit,
                                     HELD_OUT_OPEN_PROMPTS)}
    shipped = trie_drafter.RECALLED_TRUST
    report: dict[str, Any] = {"benchmark": "memory_trust", "model": "smollm2-135m-instruct",
                              "machine": machine(), "max_new_tokens": n, "budget": 16,
                              "default_trust": shipped, "settings": {}}
    for label, trust in [*((str(t), t) for t in trusts), ("no memory", None)]:
        trie_drafter.RECALLED_TRUST = shipped if trust is None else trust
        row = report["settings"][label] = {}
        for prefix, (rag, open_ended) in sets.items():  # a decoder per set: its own memory
            decoder = LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(
                budget=16, adaptive=False, compile=False, memory_mb=0 if trust is None else 64))
            for name, prompts in (("rag", rag), ("open_ended", open_ended)):
                results = [decoder.generate(p, max_new_tokens=n) for p in prompts]
                row[prefix + name] = pass_statistics([r.stats for r in results])
        print(label, row, flush=True)
    trie_drafter.RECALLED_TRUST = shipped
    out = Path("docs/benchmarks/memory_trust.json")
    out.write_text(json.dumps(report, indent=1))
    fig, axes = figure(2, (10, 4), sharey=True)
    labels = list(report["settings"])
    for ax, name in zip(axes, ("rag", "open_ended")):
        for prefix, style in (("", "o-"), ("held_out_", "s--")):
            ax.plot(labels, [report["settings"][k][prefix + name]["tokens_per_step_median"]
                              for k in labels],
                    style, label="held-out prompts" if prefix else "the bench's prompts")
    _save_panels(fig, axes, out, "a copy only earlier answers hold counts (RECALLED_TRUST)",
                 "tokens per pass at 16 nodes (median over prompts)",
                 "copies from the memory of earlier answers")


def _save_panels(fig: Any, axes: Any, out: Path, xlabel: str, ylabel: str, title: str) -> None:
    """Label the RAG and open-ended panels and write the figure beside ``out``."""
    from rag_spec.bench.report import save_figure

    for ax, name in zip(axes, ("rag", "open_ended")):
        ax.set_title(name)
        ax.set_xlabel(xlabel)
    axes[0].set_ylabel(ylabel)
    axes[0].legend()
    save_figure(fig, out.with_suffix(".png"), title)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def _chances_before(tree: Any, guess: Any, followed: dict) -> list[float]:
    """The rule before the default's: a guess's chance is its draft probability alone (a copy
    it coincides with adds nothing), every copied node 0.7 of its parent's."""
    known = dict(zip(guess.paths, guess.scores))
    chances: list[float] = []
    for path, parent in zip(tree.paths, tree.parents):
        above = chances[parent] if parent >= 0 else 1.0
        copied = (above * 0.7 if parent >= 0 else 0.45) * followed.get(path, 1.0)
        chances.append(min(known.get(path, copied), above))
    return chances


def _step_starts(result: Any) -> list[int]:
    """Where in the answer each step's tree began: the first step's root is the prompt's last
    token (a float32 prefill commits nothing), and each step commits one token more than it
    accepted."""
    starts, at = [], 0
    for accepted in result.stats.accepted_per_step:
        starts.append(at)
        at += 1 + accepted
    return starts


if __name__ == "__main__":
    main()
