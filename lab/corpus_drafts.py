"""``python -m lab.corpus_drafts``: each draft source alone and merged, interleaved on the same
prompts (issue 54's "measure each source alone and merged").

Sources: the trie (prompt, passages, answer so far, earlier answers), the corpus's suffix index
(every passage of the default knowledge base), and the shipped draft head. Rows: generate, our
decoder without drafts (the ablation), each source alone, and their merges. Per prompt set:
medians of per-prompt speedups over ``generate`` and over no drafts, tokens per pass, outputs
identical to ``generate``. Environment: ``CD_LIMIT`` prompts per set (default 8), ``CD_N`` new
tokens (96), ``CD_ROWS`` some rows only (comma-separated; no drafts always runs); writes
lab/results/corpus_drafts.json and .png.

The model's own earlier answers as a source (SuffixDecoding's corpus of outputs):
``CD_ANSWERS=N`` adds two rows beside head + trie, with the head's training answers (its 240
RAG answers and the first ``N`` written ones, from rag-spec's cache: answered first where
absent, about 15 minutes for 600 on two cores): ``head_trie_answers`` indexes them as the
trie's corpus, ``head_trie_memory`` puts them in the trie's memory of earlier answers.
``CD_FIXED=16`` verifies a fixed tree of that many nodes (tokens per pass at the issue's budget)
instead of the sized one; ``CD_HELD_OUT=1`` adds the held-out prompts (``HELD_OUT_RAG_QUESTIONS``:
the bench's next RAG questions, ``HELD_OUT_OPEN_PROMPTS``). Either writes
corpus_drafts_answers.json instead; ``CD_JSON`` names another file.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

from lab import RESULTS
from rag_spec.bench.lookahead import prompt_sets
from rag_spec.bench.prompts import (
    HELD_OUT_OPEN_PROMPTS,
    HELD_OUT_RAG_QUESTIONS,
    RAG_QUESTIONS,
)
from rag_spec.bench.report import (
    Run,
    figure,
    interleaved,
    machine,
    median,
    publish,
    runs_pass_statistics,
    save_figure,
    setting,
)
from rag_spec.drafters.trie import NGramTrie
from rag_spec.drafters.trie_drafter import TrieDrafter, TrieSession
from rag_spec.engine.decoder import ablated


class CorpusOnly(TrieDrafter):
    """The suffix index alone: no n-grams of the prompt, the answer or earlier answers."""

    def __init__(self, corpus: Any) -> None:
        super().__init__(memory_mb=0, corpus=corpus)

    def session(self, prompt: Any, extra_context: Any = ()) -> TrieSession:
        blind = NGramTrie(branch_length=self.branch_length, max_key=self.max_key, max_nodes=0)
        return TrieSession(self, blind)


def main() -> None:
    from rag_spec import LookaheadConfig
    from rag_spec.drafters.draft_head import find_head
    from rag_spec.drafters.feature_drafter import FeatureDrafter
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.drafters.suffix_index import SuffixIndex
    from rag_spec.models import load_model
    from rag_spec.retrieval import KnowledgeBase

    limit, n = int(os.environ.get("CD_LIMIT", 8)), int(os.environ.get("CD_N", 96))
    written, fixed = int(os.environ.get("CD_ANSWERS", 0)), int(os.environ.get("CD_FIXED", 0))
    lm = load_model("smollm2-135m-instruct")
    sets = dict(zip(("rag", "open_ended"),
                    prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit)))
    if os.environ.get("CD_HELD_OUT") == "1":
        sets.update(zip(("held_out_rag", "held_out_open_ended"), prompt_sets(
            lm.tokenizer, HELD_OUT_RAG_QUESTIONS[:limit], limit, HELD_OUT_OPEN_PROMPTS)))
    kb = KnowledgeBase.load_default("flat")
    started = time.perf_counter()
    index = SuffixIndex.from_texts([p.text for p in kb.passages], lm.tokenizer, progress=True)
    built_s = time.perf_counter() - started
    head = find_head(lm.model)
    if head is None:
        msg = "no draft head for the embedded model (rag-spec draft train --head)"
        raise SystemExit(msg)

    def decoder(drafter: Any, **config: Any) -> Any:
        sized = not fixed or "budget" in config
        if not sized:
            config.update(budget=fixed)
        return ablated(lm.model, lm.tokenizer, LookaheadConfig(**config), drafter=drafter,
                       adaptive=sized)

    decoders = {
        "no_drafts": decoder(TrieDrafter(), budget=0),
        "trie": decoder(TrieDrafter()),
        "corpus": decoder(CorpusOnly(index)),
        "trie_corpus": decoder(TrieDrafter(corpus=index)),
        "head": decoder(FeatureDrafter(head)),
        "head_trie": decoder(MergedDrafter(FeatureDrafter(head))),
        "head_trie_corpus": decoder(MergedDrafter(FeatureDrafter(head),
                                                  TrieDrafter(corpus=index))),
    }
    answers: list[list[int]] = head_answers(lm, written) if written else []
    if written:
        memory = TrieDrafter()
        for answer in answers:
            memory.remember(answer)
        decoders["head_trie_answers"] = decoder(MergedDrafter(
            FeatureDrafter(head), TrieDrafter(corpus=SuffixIndex(answers))))
        decoders["head_trie_memory"] = decoder(MergedDrafter(FeatureDrafter(head), memory))

    def hf(prompt: list[int]) -> Run:
        ids = torch.tensor([prompt])
        out = lm.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=n)
        return Run(0.0, out[0, len(prompt):].tolist())

    def ours(d: Any, prompt: list[int]) -> Run:
        result = d.generate(prompt, max_new_tokens=n)
        return Run(0.0, result.token_ids, {"stats": [result.stats]})

    rows = os.environ.get("CD_ROWS")
    if rows:
        decoders = {k: v for k, v in decoders.items()
                    if k == "no_drafts" or k in rows.split(",")}
    systems: dict[str, Any] = {"hf": hf}
    systems.update({name: (lambda p, d=d: ours(d, p)) for name, d in decoders.items()})
    for system in systems.values():
        system(sets["rag"][0][:64])  # warm-up
    report: dict[str, Any] = {
        "benchmark": "corpus_drafts", "model": "smollm2-135m-instruct", "dtype": "float32",
        "max_new_tokens": n, "machine": machine(), "fixed_nodes": fixed or None,
        "corpus": {"passages": len(kb.passages), "tokens": len(index),
                   "build_s": round(built_s, 2), "mb": round(index.nbytes / 2**20, 1)},
        "answers": {"answers": len(answers), "tokens": sum(map(len, answers))}}
    for name, prompts in sets.items():
        runs = interleaved(systems, prompts)
        base, plain = runs["hf"], runs["no_drafts"]
        report[name] = {"prompts": len(prompts), "systems": {s: {
            "speedup_vs_hf": round(median([b.seconds / r.seconds for b, r in
                                           zip(base, runs[s])]), 3),
            "over_no_drafts": round(median([p.seconds / r.seconds for p, r in
                                            zip(plain, runs[s])]), 3),
            **runs_pass_statistics(runs[s]),
            "identical_to_hf": sum(r.tokens == b.tokens for b, r in zip(base, runs[s])),
            "per_prompt_speedup": [round(b.seconds / r.seconds, 3)
                                   for b, r in zip(base, runs[s])],
        } for s in decoders}}
    variant = written or fixed or len(sets) > 2  # not the sources' default comparison
    publish(report, os.environ.get("CD_JSON"),
            "corpus_drafts_answers" if variant else "corpus_drafts", _plot, _table, RESULTS)


def head_answers(lm: Any, written: int) -> list[list[int]]:
    """The answers the shipped head trained on (its 240 and the first ``written`` of its
    written ones), without their prompts."""
    from rag_spec.corpus import load_passages
    from rag_spec.training.data import training_answers

    return [answer for _, answer in training_answers(lm, load_passages(), 240, written)]


def _prompt_sets(report: dict[str, Any]) -> list[str]:
    """The report's prompt sets (RAG and open-ended, then any held out), in the order run."""
    return [k for k in report if k.endswith(("rag", "open_ended"))]


def _plot(report: dict[str, Any], path: Path) -> None:
    names = _prompt_sets(report)
    fig, axes = figure(len(names), (6 * len(names), 4.5), sharey=True)
    for ax, name in zip(axes, names):
        data = report[name]["systems"]
        ax.bar(list(data), [s["speedup_vs_hf"] for s in data.values()])
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.tick_params(axis="x", rotation=45)
        ax.set_title(f"{name}: {report[name]['prompts']} prompts")
        ax.set_ylabel("median speedup vs transformers greedy")
    fixed = report.get("fixed_nodes")
    save_figure(fig, path, f"{setting(report)}, {report['max_new_tokens']} new tokens"
                + (f", fixed {fixed}-node trees" if fixed else ""))


def _table(report: dict[str, Any]) -> None:
    corpus = report["corpus"]
    print(f"suffix index: {corpus['passages']} passages, {corpus['tokens']} tokens, "
          f"built in {corpus['build_s']} s, {corpus['mb']} MB")
    for name in _prompt_sets(report):
        print(f"\n{name} ({report[name]['prompts']} prompts)")
        print(f"{'drafts':18} {'vs generate':>12} {'vs no drafts':>13} {'tok/pass':>9} "
              f"{'identical':>10}")
        for system, s in report[name]["systems"].items():
            print(f"{system:18} {s['speedup_vs_hf']:11.2f}x {s['over_no_drafts']:12.2f}x "
                  f"{s['tokens_per_step']:9.2f} {s['identical_to_hf']:>10}")


if __name__ == "__main__":
    main()
