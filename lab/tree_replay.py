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
open-ended prompts below); writes lab/results/tree_replay[_held_out].json and .png.

``TR_TRUSTS=1,0.3,0.1`` instead decodes (no replay: each setting's own steps) at the same fixed
16 nodes, the fitted and the held-out prompts, with each ``RECALLED_TRUST`` listed and with no
memory of earlier answers: tokens per pass, medians over prompts and pooled; writes
lab/results/memory_trust.json and .png.

``TR_POOLS=1`` decodes the held-out prompts at the same fixed 16 nodes with the head's default
shape and with a wider, deeper one offered 48 nodes (a larger pool for the ranking to cut from),
and with the head at ``TR_HEAD`` (a file ``rag-spec draft train --head`` wrote) if given:
tokens per pass decoded and the ceiling of each pool, against issue 54's goals (3.0 / 2.2);
writes lab/results/draft_pools_held_out.json and .png.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path
from typing import Any

from lab import RESULTS
from rag_spec.engine.decoder import ablated

CUTS = (4, 8, 16)
CEILING = "every drafted node, uncut (the ceiling)"


def main() -> None:
    if os.environ.get("TR_POOLS") == "1":
        pool_sweep()
        return
    if os.environ.get("TR_TRUSTS"):
        trust_sweep([float(t) for t in os.environ["TR_TRUSTS"].split(",")])
        return
    import rag_spec.drafters.merged_drafter as merged
    from rag_spec import LookaheadConfig
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
    decoder = ablated(lm.model, lm.tokenizer,
                      LookaheadConfig(budget=16, compile=False), adaptive=False)
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
    out = RESULTS / f"tree_replay{'_held_out' if held_out else ''}.json"
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
    from rag_spec import LookaheadConfig
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
            config = LookaheadConfig(budget=16, compile=False,
                                     memory_mb=0 if trust is None else 64)
            decoder = ablated(lm.model, lm.tokenizer, config, adaptive=False)
            for name, prompts in (("rag", rag), ("open_ended", open_ended)):
                results = [decoder.generate(p, max_new_tokens=n) for p in prompts]
                row[prefix + name] = pass_statistics([r.stats for r in results])
        print(label, row, flush=True)
    trie_drafter.RECALLED_TRUST = shipped
    out = RESULTS / "memory_trust.json"
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


def pool_sweep() -> None:
    """Tokens per pass at a fixed 16 nodes, decoded, and every drafted node's (the ceiling),
    per draft pool, interleaved prompt by prompt on the held-out prompts."""
    import rag_spec.drafters.merged_drafter as merged
    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, HELD_OUT_RAG_QUESTIONS
    from rag_spec.bench.report import machine
    from rag_spec.drafters.draft_head import SHIPPED, load_head, model_fingerprint
    from rag_spec.drafters.feature_drafter import FeatureDrafter
    from rag_spec.drafters.trie_drafter import TrieConfig, TrieDrafter
    from rag_spec.models import load_model
    from rag_spec.policy.expansion import Expansion

    limit, n = int(os.environ.get("TR_LIMIT", 8)), int(os.environ.get("TR_N", 128))
    lm = load_model("smollm2-135m-instruct")
    shipped = load_head(lm.model, SHIPPED / f"{model_fingerprint(lm.model)}.safetensors")
    wide = Expansion(top=8, min_prob=0.01, max_depth=6, grow_prob=0.05)
    pools = {"shipped head, default shape": (shipped, None, None),
             "shipped head, 6 deep past 5%, offered 48 nodes": (shipped, wide, 48)}
    if os.environ.get("TR_HEAD"):
        label = os.environ.get("TR_HEAD_LABEL", "TR_HEAD's head")
        pools[f"{label}, default shape"] = (
            load_head(lm.model, Path(os.environ["TR_HEAD"])), None, None)
    share, merge, offered, steps = merged.merged_share, merged._merged, [None], []

    def offering(budget: int, copies: int, *, ranked: bool = False) -> int:
        return offered[0] if ranked and offered[0] else share(budget, copies, ranked=ranked)

    def recording(guess: Any, copies: Any, grafts: Any, budget: int) -> Any:
        steps.append((guess, copies, grafts))
        return merge(guess, copies, grafts, budget)

    # this process's decoders only, put back after: a lab run, not the library's use
    merged.merged_share, merged._merged = offering, recording
    try:
        config = LookaheadConfig(budget=16, adaptive=False, compile=False)
        decoders = {name: (LookaheadDecoder(lm.model, lm.tokenizer, config, drafter=(
            merged.MergedDrafter(FeatureDrafter(head, expansion=shape),
                                 TrieDrafter.from_config(TrieConfig())))), nodes)
            for name, (head, shape, nodes) in pools.items()}
        rag, open_ended = prompt_sets(lm.tokenizer, HELD_OUT_RAG_QUESTIONS[:limit], limit,
                                      HELD_OUT_OPEN_PROMPTS)
        report: dict[str, Any] = {"benchmark": "draft_pools", "model": "smollm2-135m-instruct",
                                  "machine": machine(), "max_new_tokens": n, "budget": 16,
                                  "held_out": True, "goals": {"rag": 3.0, "open_ended": 2.2}}
        for name, prompts in (("rag", rag), ("open_ended", open_ended)):
            report[name] = _pool_rows(decoders, prompts, n, steps, offered, merge)
            print(name, report[name], flush=True)
    finally:
        merged.merged_share, merged._merged = share, merge
    report["extra_head"] = os.environ.get("TR_HEAD")
    out = RESULTS / "draft_pools_held_out.json"
    out.write_text(json.dumps(report, indent=1))
    plot_pools(report, out)


def _pool_rows(decoders: dict[str, Any], prompts: list, n: int, steps: list, offered: list,
               merge: Any) -> dict[str, Any]:
    """Per pool, medians over ``prompts`` of tokens per pass decoded and uncut, and of nodes
    drafted; ``steps`` is what the recording merge kept, ``offered`` the head's share."""
    rows: dict[str, dict[str, list[float]]] = {
        pool: {"decoded": [], "ceiling": [], "drafted_nodes": []} for pool in decoders}
    identical = dict.fromkeys(decoders, 0)
    for prompt in prompts:  # interleaved: every pool on a prompt before the next prompt
        first = None
        for pool, (decoder, nodes) in decoders.items():
            offered[0] = nodes
            steps.clear()
            result = decoder.generate(prompt, max_new_tokens=n)
            answer, first = result.token_ids, first or result.token_ids
            identical[pool] += answer == first
            starts = _step_starts(result)
            assert len(starts) == len(steps), "a step merged no drafts: the replay misaligns"
            uncut = [merge(*step, 10**6) for step in steps]
            rows[pool]["decoded"].append(statistics.mean(
                1 + a for a in result.stats.accepted_per_step))
            rows[pool]["ceiling"].append(statistics.mean(
                1 + len(tree.follow(answer[start:])) for start, tree in zip(starts, uncut)))
            rows[pool]["drafted_nodes"].append(statistics.mean(len(t) for t in uncut))
    return {pool: {**{k: round(statistics.median(v), 3) for k, v in row.items()},
                   "identical_to_default": identical[pool]} for pool, row in rows.items()}


def plot_pools(report: dict[str, Any], out: Path) -> None:
    """The pools' bars beside the goals' lines, written beside ``out``."""
    from rag_spec.bench.report import figure

    pools = list(report["rag"])
    fig, axes = figure(2, (11, 4), sharey=True)
    for ax, name in zip(axes, ("rag", "open_ended")):
        at = range(len(pools))
        ax.bar([i - 0.2 for i in at], [report[name][p]["decoded"] for p in pools], 0.4,
               label="decoded at 16 nodes")
        ax.bar([i + 0.2 for i in at], [report[name][p]["ceiling"] for p in pools], 0.4,
               label="every drafted node (ceiling)")
        ax.axhline(report["goals"][name], color="k", lw=0.8, ls="--", label="issue 54's goal")
        ax.set_xticks(list(at), [p.replace(", ", ",\n") for p in pools], fontsize=7)
    _save_panels(fig, axes, out, "draft pool", "tokens per pass (median over prompts)",
                 "held-out prompts: what the drafts hold at 16 nodes")


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
