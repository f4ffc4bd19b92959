"""``python -m lab.step_profile``: where a speculative step's cost goes (issue 54's "an average
speculative step costs <= 1.3x a no-draft step: profile where the rest goes").

Systems, interleaved per prompt on the lookahead bench's RAG and open-ended prompts: our decoder
without drafts (the ablation), the default decoder as a user constructs it (head + trie,
adaptive trees), and the same drafts at a fixed 16-node tree (what the sizing policy builds
where a wide step costs what a narrow one does: a GPU). Per system, medians over prompts:
tokens and nodes per pass, the speedup over no drafts and the step's cost over a no-draft step
(wall time per pass, the prefill excluded), split into drafting, the forward pass, bookkeeping
(verification, the cache's compaction) and the rest (stop rules, text); and, timed per call,
the parts of those a drafting step adds (``CALLS``: the head's pass, its round, the trie's
lookups, the merge, the trie learning the new tokens, verification, compaction). Then the
forward pass alone, 1 to 17 tokens wide after a RAG-length prompt, which says what the width
costs on this CPU: eager passes (``lab.floor.runner_step_seconds`` grows its cache, so steps
compiled ahead of time do not run there; the decoder's own passes are in the split above).
Environment: ``SP_LIMIT`` prompts per set (default 8), ``SP_N`` new tokens (128); writes
lab/results/step_profile.json and .png.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lab import RESULTS
from rag_spec.bench.lookahead import prompt_sets
from rag_spec.bench.prompts import RAG_QUESTIONS
from rag_spec.bench.report import (
    Run,
    figure,
    interleaved,
    machine,
    median,
    pass_statistics,
    publish,
    save_figure,
    setting,
)
from rag_spec.engine.decoder import ablated

WIDTHS = (1, 2, 4, 6, 8, 10, 12, 14, 17)
# the calls timed inside a step: (module, class or None, function); a lookup inside another
# (the trie's, within the copies after guesses) counts in both
CALLS = {"head pass": ("rag_spec.drafters.feature_drafter", "_HeadPasses", "forward"),
         "head round": ("rag_spec.drafters.model_drafter", "ModelDrafter", "propose"),
         "trie lookups": ("rag_spec.drafters.trie_drafter", "TrieSession", "propose"),
         "copies after guesses": ("rag_spec.drafters.merged_drafter", None, "_extensions"),
         "merge": ("rag_spec.drafters.merged_drafter", None, "_merged"),
         "trie learning": ("rag_spec.drafters.trie_drafter", "TrieSession", "observe"),
         "verify": ("rag_spec.engine.batch", None, "verify"),
         "cache compaction": ("rag_spec.target.transformers.tree_cache", "TreeKVCache", "keep")}


def main() -> None:
    from lab.floor import runner_step_seconds
    from rag_spec import LookaheadConfig, LookaheadDecoder
    from rag_spec.models import load_model

    limit, n = int(os.environ.get("SP_LIMIT", 8)), int(os.environ.get("SP_N", 128))
    lm = load_model("smollm2-135m-instruct")
    rag, open_ended = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit)
    decoders = {"no_drafts": LookaheadDecoder(lm.model, lm.tokenizer, LookaheadConfig(budget=0)),
                "default": LookaheadDecoder(lm.model, lm.tokenizer),
                "fixed_16": ablated(lm.model, lm.tokenizer,
                                    LookaheadConfig(budget=16), adaptive=False)}
    for decoder in decoders.values():  # first use: kernels prepared, step costs timed
        decoder.generate(rag[0], 16)
    calls = _timed_calls()
    systems = {name: _system(decoder, n, calls) for name, decoder in decoders.items()}
    report: dict[str, Any] = {"benchmark": "step_profile", "model": "smollm2-135m-instruct",
                              "dtype": "float32", "machine": machine(), "max_new_tokens": n,
                              "drafts": decoders["default"].drafter.label}
    for name, prompts in (("rag", rag), ("open_ended", open_ended)):
        print(f"{name}: {len(prompts)} prompts")
        report[name] = _summarise(interleaved(systems, prompts))
    context = round(median([len(p) for p in rag]))
    widths = runner_step_seconds(lm.model, list(range(100, 100 + context)), WIDTHS, repeats=7)
    report["forward_ms_by_width"] = {str(w): round(1000 * s, 2) for w, s in widths.items()}
    report["forward_over_one_token"] = {str(w): round(s / widths[1], 3)
                                        for w, s in widths.items()}
    report["context_tokens"] = context
    publish(report, None, "step_profile", _plot, _print_table, RESULTS)


def _timed_calls() -> dict[str, float]:
    """Wrap ``CALLS`` in this process (a lab run's, not the library's use) to add each one's
    seconds to the returned dict, which each run reads and resets."""
    import importlib
    import time

    seconds = dict.fromkeys(CALLS, 0.0)
    for label, (module_name, owner_name, name) in CALLS.items():
        module = importlib.import_module(module_name)
        owner = module if owner_name is None else getattr(module, owner_name)
        inner = getattr(owner, name)

        def timed(*args: Any, _inner: Any = inner, _label: str = label, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                seconds[_label] += time.perf_counter() - started
        setattr(owner, name, timed)
    return seconds


def _system(decoder: Any, n: int, calls: dict[str, float]) -> Any:
    def call(prompt: list[int]) -> Run:
        for label in calls:
            calls[label] = 0.0
        result = decoder.generate(prompt, n)
        per_pass = {label: 1000 * s / result.stats.steps for label, s in calls.items()}
        return Run(0.0, result.token_ids, {"stats": result.stats, "calls_ms": per_pass})
    return call


def _summarise(runs: dict[str, list[Run]]) -> dict[str, Any]:
    """Per system: tokens per pass (``pass_statistics``); medians over prompts of nodes per
    pass, the speedup and the step's cost over no drafts, and milliseconds per pass in each
    part of a step."""
    def step_ms(run: Run) -> float:  # wall time per pass, the prefill excluded
        stats = run.extra["stats"]
        return 1000 * (run.seconds - stats.prefill_seconds) / stats.steps

    plain = runs["no_drafts"]
    parts = {name: _parts(mine, step_ms) for name, mine in runs.items()}
    summary: dict[str, Any] = {"prompts": len(plain)}
    for name, mine in runs.items():
        stats = [r.extra["stats"] for r in mine]
        summary[name] = {
            **pass_statistics(stats),
            "nodes_per_pass": round(median([s.drafted / s.steps for s in stats]), 2),
            "speedup_vs_no_drafts": round(median([p.seconds / m.seconds
                                                  for p, m in zip(plain, mine)]), 3),
            "step_over_no_draft_step": round(median([step_ms(m) / step_ms(p)
                                                     for p, m in zip(plain, mine)]), 3),
            "forward_over_no_draft_forward": round(median([
                f / q for f, q in zip(parts[name]["forward"], parts["no_drafts"]["forward"])]),
                3),
            "ms_per_pass": {part: round(median(v), 2) for part, v in parts[name].items()},
            "calls_ms_per_pass": {label: round(median([r.extra["calls_ms"][label] for r in mine]),
                                               3) for label in CALLS},
            "identical_to_no_drafts": sum(m.tokens == p.tokens for m, p in zip(mine, plain))}
    return summary


def _parts(runs: list[Run], step_ms: Any) -> dict[str, list[float]]:
    """Milliseconds per pass in drafting, the forward pass, bookkeeping and the rest, per run."""
    stats = [r.extra["stats"] for r in runs]
    parts = {"draft": [1000 * s.draft_seconds / s.steps for s in stats],
             "forward": [1000 * s.forward_seconds / s.steps for s in stats],
             "bookkeeping": [1000 * s.bookkeeping_seconds / s.steps for s in stats]}
    parts["rest"] = [step_ms(r) - sum(p[i] for p in parts.values()) for i, r in enumerate(runs)]
    return parts


def _print_table(report: dict[str, Any]) -> None:
    for name in ("rag", "open_ended"):
        print(f"{name}: system | tokens/pass | nodes/pass | vs no drafts | step cost | "
              f"forward cost | ms draft / forward / bookkeeping / rest")
        for system, entry in report[name].items():
            if system == "prompts":
                continue
            ms = " / ".join(f"{v:.1f}" for v in entry["ms_per_pass"].values())
            print(f"  {system} | {entry['tokens_per_step']} | {entry['nodes_per_pass']} | "
                  f"{entry['speedup_vs_no_drafts']}x | {entry['step_over_no_draft_step']}x | "
                  f"{entry['forward_over_no_draft_forward']}x | {ms}")
        calls = report[name]["default"]["calls_ms_per_pass"]
        print("  default, ms per pass in calls:", ", ".join(f"{k} {v:.2f}"
                                                          for k, v in calls.items()))
    print("eager forward pass by width (x one token):", report["forward_over_one_token"])


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, (parts_axis, width_axis) = figure(2, (12, 4.5))
    labels, bottoms = [], []
    for name in ("rag", "open_ended"):
        for system, entry in report[name].items():
            if system != "prompts":
                labels.append(f"{name}\n{system}")
                bottoms.append(entry["ms_per_pass"])
    left = [0.0] * len(labels)
    for part in ("forward", "draft", "bookkeeping", "rest"):
        values = [b[part] for b in bottoms]
        parts_axis.barh(labels, values, left=left, label=part)
        left = [x + v for x, v in zip(left, values)]
    parts_axis.invert_yaxis()
    parts_axis.set_xlabel("ms per forward pass (median over prompts)")
    parts_axis.legend(fontsize=8)
    widths = report["forward_over_one_token"]
    width_axis.plot([int(w) for w in widths], list(widths.values()), marker="o")
    width_axis.axhline(1.3, color="k", lw=0.8, ls="--")
    width_axis.set_xlabel(f"tokens in the pass (after {report['context_tokens']} of context)")
    width_axis.set_ylabel("eager forward pass / one-token pass")
    save_figure(fig, path, f"{setting(report)}: where a step's cost goes")


if __name__ == "__main__":
    main()
