"""``python -m lab.head_depths``: how deep the draft head should draft, and the shipped head
against an earlier one.

Systems, interleaved per prompt on the lookahead bench's RAG and open-ended prompts (compiled
steps where packaged, as a user gets them): ``generate`` (the peer), our decoder without drafts
(the ablation), and the head merged with the trie as the default builds it (up to four passes
deep, each below a path of at least 20%: ``Expansion(max_depth=4, grow_prob=0.2)``), then with
its trees one pass deep, two past a first guess of 50% (the default before) and two always;
with ``HD_OLD`` (a head file for the same model, e.g. ``git show
3010838:rag_spec/drafters/heads/<fingerprint>.safetensors``) that head in the default's shape
and one deep too (the head under test is the one the default finds: one trained with ``rag-spec
draft train --head`` in rag-spec's cache before the shipped one). Per
system, medians over prompts of the speedup over no drafts and over ``generate``, tokens per
pass (the mean over prompts, the median, and pooled: all tokens over all passes; with more than 8
prompts, also over the bench's first 8 and over the held-out rest), and how many outputs equal
``generate``'s. Environment: ``HD_LIMIT``
prompts per set (default 8; up to 16, the held-out open-ended prompts after the bench's: a
prompt asked twice would be copied from its first answer), ``HD_N`` new tokens (128),
``HD_FIXED`` a fixed tree of that many nodes for every drafting system instead of the adaptive
default's (16: the verification budget of issue 54's tokens-per-pass goal, what a GPU's sizing
builds); writes lab/results/head_depths.json (``head_depths_fixed16.json`` with
``HD_FIXED=16``) and .png.
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Any

from lab import RESULTS
from rag_spec.bench.lookahead import _systems, prompt_sets
from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, OPEN_PROMPTS, RAG_QUESTIONS
from rag_spec.bench.report import (
    figure,
    interleaved,
    machine,
    publish,
    runs_pass_statistics,
    save_figure,
)
from rag_spec.engine.decoder import ablated

_SHAPE = {"top": 8, "min_prob": 0.02}


def main() -> None:
    from rag_spec import (
        FeatureDrafter,
        LookaheadConfig,
        LookaheadDecoder,
        MergedDrafter,
        TrieDrafter,
    )
    from rag_spec.drafters.draft_head import find_head, load_head
    from rag_spec.models import load_model
    from rag_spec.policy.expansion import Expansion

    limit, n = int(os.environ.get("HD_LIMIT", 8)), int(os.environ.get("HD_N", 128))
    fixed = int(os.environ.get("HD_FIXED", 0))
    config = LookaheadConfig(budget=fixed) if fixed else LookaheadConfig()
    lm = load_model("smollm2-135m-instruct")
    rag, open_ended = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit,
                                  OPEN_PROMPTS + HELD_OUT_OPEN_PROMPTS)
    shipped = find_head(lm.model)
    assert shipped is not None, "no head for the embedded model: run python -m lab.ship_head"

    def merged(head: Any, expansion: Expansion | None) -> Any:
        drafter = MergedDrafter(FeatureDrafter(head, expansion=expansion), TrieDrafter())
        return ablated(lm.model, lm.tokenizer, config, drafter, adaptive=not fixed)

    shapes = {"head_default": None, "head_one_deep": Expansion(**_SHAPE, max_depth=1),
              "head_two_deep_past_half": Expansion(**_SHAPE, max_depth=2, grow_prob=0.5),
              "head_two_deep_always": Expansion(**_SHAPE, max_depth=2)}
    decoders = {"no_drafts": LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0),
                                              drafter=TrieDrafter()),
                **{name: merged(shipped, shape) for name, shape in shapes.items()}}
    if os.environ.get("HD_OLD"):
        old = load_head(lm.model, Path(os.environ["HD_OLD"]))
        decoders["old_head_default"] = merged(old, None)
        decoders["old_head_one_deep"] = merged(old, shapes["head_one_deep"])
    for decoder in decoders.values():  # first use: kernels prepared, step costs timed
        decoder.generate(rag[0], 16)

    # the lookahead bench's systems (generate and our decoders), without prompt lookup
    systems = _systems(lm.model, decoders, n)
    systems = {"generate": systems.pop("hf"), **{name: systems[name] for name in decoders}}
    report: dict[str, Any] = {"benchmark": "head_depths", "model": "smollm2-135m-instruct",
                              "dtype": "float32", "machine": machine(), "max_new_tokens": n,
                              "passes": "eager" if decoders["no_drafts"].runner.compiled
                              is None else "compiled", "head_agreement": shipped.agreement,
                              "old_head": os.environ.get("HD_OLD"),
                              "nodes": fixed or "adaptive (the default's)"}
    for name, prompts in (("rag", rag), ("open_ended", open_ended)):
        print(f"{name}: {len(prompts)} prompts")
        runs = interleaved(systems, prompts)
        plain, peer = runs["no_drafts"], runs["generate"]
        report[name] = {"prompts": len(prompts), **{system: {
            "speedup_vs_no_drafts": round(statistics.median(
                [p.seconds / m.seconds for p, m in zip(plain, mine)]), 3),
            "speedup_vs_generate": round(statistics.median(
                [g.seconds / m.seconds for g, m in zip(peer, mine)]), 3),
            **_passes(mine, ""), **(_passes(mine[:8], "_bench_prompts")
                                    | _passes(mine[8:], "_held_out") if len(mine) > 8 else {}),
            "identical_to_generate": sum(m.tokens == g.tokens for m, g in zip(mine, peer))}
            for system, mine in runs.items()}}
    publish(report, None, f"head_depths_fixed{fixed}" if fixed else "head_depths", _plot,
            _print_table, RESULTS)


def _passes(runs: list[Any], suffix: str) -> dict[str, float]:
    """Tokens per pass of ``runs`` (``runs_pass_statistics``: the mean over prompts, the median,
    pooled), named as this lab's reports name them; 1 for ``generate``."""
    found = runs_pass_statistics(runs) or {
        key: 1.0 for key in ("tokens_per_step", "tokens_per_step_median",
                             "tokens_per_step_pooled")}
    return {key.replace("tokens_per_step", "tokens_per_pass") + suffix: value
            for key, value in found.items()}


def _print_table(report: dict[str, Any]) -> None:
    for name in ("rag", "open_ended"):
        print(f"{name} ({report[name]['prompts']} prompts)")
        for system, row in report[name].items():
            if system != "prompts":
                print(f"  {system:24} {row['speedup_vs_no_drafts']:.3f}x no drafts  "
                      f"{row['speedup_vs_generate']:.3f}x generate  "
                      f"{row['tokens_per_pass']:.2f} tok/pass "
                      f"(median {row['tokens_per_pass_median']:.2f}, pooled "
                      f"{row['tokens_per_pass_pooled']:.2f})  "
                      f"{row['identical_to_generate']}/{report[name]['prompts']} identical")


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, axes = figure(2, (11, 4), sharey=True)
    for ax, name in zip(axes, ("rag", "open_ended")):
        rows = {s: r for s, r in report[name].items() if s not in ("prompts", "generate")}
        bars = ax.bar(list(rows), [r["speedup_vs_no_drafts"] for r in rows.values()])
        for bar, row in zip(bars, rows.values()):
            ax.annotate(f"{row['tokens_per_pass']:.2f} tok/pass",
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{name}: {report[name]['prompts']} prompts")
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    axes[0].set_ylabel("speedup over our decoder without drafts (median)")
    save_figure(fig, path, "draft head depth, merged with the trie")


if __name__ == "__main__":
    main()
