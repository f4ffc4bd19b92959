"""``rag-spec bench draft``: drafts that compute, against transformers' assisted generation.

The draft on this CPU is the target's own first ``layers`` layers, three ways: saved as a model
folder of its own (what ``assistant_model`` and ``DraftModelDrafter`` take), as an early exit
(``assistant_early_exit`` and ``EarlyExitDrafter``), and as an early exit with the adapter
``rag-spec draft train`` trains (a decoder layer and a smaller head, on the default corpus);
also the draft head ``rag-spec draft train --head`` trains (EAGLE-style, on the target's last
hidden states: ``FeatureDrafter``).
Systems run interleaved on each prompt; greedy runs are compared token for token with
transformers greedy, sampled runs (temperature 0.7, top-p 0.9) report speed only (their
outputs differ by design, not their distribution: the tests check that).
``rag_spec_no_drafts`` is our decoder drafting nothing: the kernels without speculation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from rag_spec.bench.lookahead import prompt_sets
from rag_spec.bench.report import (
    DRAFT_MODES,
    Run,
    dequantized,
    figure,
    interleaved,
    machine,
    median,
    padded_generate,
    publish,
    rows_run,
    rows_summary,
    save_figure,
)
from rag_spec.bench.report import setting as describe

SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.9}
GREEDY_SYSTEMS = ("hf", "hf_assisted", "hf_assisted_heuristic", "hf_early_exit",
                  "rag_spec_no_drafts", "rag_spec_trie", "rag_spec_draft_chain",
                  "rag_spec_draft_tree", "rag_spec_early_exit", "rag_spec_trained_exit",
                  "rag_spec_draft_head", "rag_spec_merged", "rag_spec_merged_trained_exit",
                  "rag_spec_merged_draft_head")
SAMPLED_SYSTEMS = ("hf", "hf_assisted", "rag_spec_no_drafts", "rag_spec_draft_tree",
                   "rag_spec_draft_head", "rag_spec_merged")
BATCH_SYSTEMS = ("hf", "rag_spec_no_drafts", "rag_spec_trie", "rag_spec_draft_tree",
                 "rag_spec_merged")


def run(json_out: str | None = None, max_new_tokens: int = 64, limit: int = 6,
        layers: int = 8, batch: int = 4, model_name: str = "smollm2-135m-instruct",
        modes: Sequence[str] = DRAFT_MODES) -> dict[str, Any]:
    """Run the benchmark (the runs ``modes`` names), print a table, write JSON and a PNG plot;
    return the report."""
    from rag_spec.bench.prompts import RAG_QUESTIONS
    from rag_spec.models import load_model
    from rag_spec.training.train_exit import cached_exit
    from rag_spec.training.train_head import cached_head

    lm = load_model(model_name)
    draft = load_model(str(first_layers_folder(lm, layers)))
    adapter = cached_exit(lm, layers, train=False)  # `rag-spec draft train` trains them
    head = cached_head(lm, train=False)
    rag, open_ended = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:limit], limit)
    report: dict[str, Any] = {"benchmark": "draft", "model": model_name, "dtype": str(lm.dtype),
                              "draft": f"the model's first {layers} layers", "layers": layers,
                              "exit_agreement": adapter.agreement,
                              "head_agreement": head.agreement,
                              "max_new_tokens": max_new_tokens, "machine": machine()}
    for mode, names, options in (("greedy", GREEDY_SYSTEMS, {}),
                                 ("sampling", SAMPLED_SYSTEMS, SAMPLING)):
        if mode not in modes:
            continue
        systems = _systems(lm, draft.model, adapter, head, max_new_tokens, options)
        systems = {name: systems[name] for name in names}
        for system in systems.values():  # warm up: runners built, kernels primed
            system([rag[0][:48]])
        report[mode] = {}
        for name, prompts in (("rag", rag), ("open_ended", open_ended)):
            print(f"{mode}, {name}: {len(prompts)} prompts")
            runs = interleaved(systems, [[p] for p in prompts])
            report[mode][name] = rows_summary(runs, check=not options)
    if "batch" in modes:
        systems = _systems(lm, draft.model, adapter, head, max_new_tokens, {})
        batches = [rag[i:i + batch] for i in range(0, len(rag) - batch + 1, batch)] or [rag]
        print(f"greedy, batch {batch}: {len(batches)} batches")
        runs = interleaved({name: systems[name] for name in BATCH_SYSTEMS}, batches)
        report[f"greedy_batch{batch}"] = {"rag": rows_summary(runs, check=True)}
    publish(report, json_out, "draft", _plot, _print_table)
    return report


def first_layers_folder(lm: Any, layers: int) -> Path:
    """The model's first ``layers`` layers (with its embeddings, final norm and head) saved as a
    model folder of its own, once, in rag-spec's cache: a draft both peers can load."""
    from transformers import AutoModelForCausalLM

    from rag_spec.paths import atomic_dir, cache_dir

    folder = cache_dir() / "drafts" / f"{lm.name}-first-{layers}-layers"
    if (folder / "config.json").is_file():
        return folder
    config = type(lm.model.config).from_dict(lm.model.config.to_dict())
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    draft = AutoModelForCausalLM.from_config(config)
    draft.load_state_dict(lm.model.state_dict(), strict=False)  # layers >= L are left out
    with atomic_dir(folder) as scratch:
        draft.save_pretrained(scratch)
        lm.tokenizer.save_pretrained(scratch)
    return folder


def _systems(lm: Any, draft: Any, adapter: Any, head: Any, max_new_tokens: int,
             options: dict[str, Any]) -> dict[str, Callable[[list[list[int]]], Run]]:
    from rag_spec.drafters.feature_drafter import FeatureDrafter
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.drafters.model_drafter import DraftModelDrafter, EarlyExitDrafter
    from rag_spec.engine.decoder import LookaheadDecoder
    from rag_spec.policy.expansion import Expansion

    model, layers = lm.model, adapter.layers

    def hf(prompts: list[list[int]], **kwargs: Any) -> Run:
        seed = torch.random.get_rng_state()
        torch.manual_seed(0)
        rows = padded_generate(model, prompts, lm.tokenizer.pad_token_id,
                               max_new_tokens=max_new_tokens, **options, **kwargs)
        torch.random.set_rng_state(seed)
        return rows_run(rows)

    def ours(decoder: Any) -> Callable[[list[list[int]]], Run]:
        def generate(prompts: list[list[int]]) -> Run:
            results = decoder.generate(prompts, max_new_tokens=max_new_tokens, seed=0, **options)
            results = results if isinstance(results, list) else [results]
            return rows_run([r.token_ids for r in results], {
                "stats": [r.stats for r in results],
                "seconds_per_step": median([(r.stats.draft_seconds + r.stats.forward_seconds
                                             + r.stats.bookkeeping_seconds) / r.stats.steps
                                            for r in results]),
                "accepted_share": median([sum(r.stats.accepted_per_step) / max(r.stats.drafted, 1)
                                          for r in results])})
        return generate

    def decoder(drafter: Any = None, **config: Any) -> Callable[[list[list[int]]], Run]:
        return ours(LookaheadDecoder(model, lm.tokenizer, dequantized(**config),
                                     drafter=drafter))

    return {
        "hf": hf,
        "hf_assisted": lambda p: hf(p, assistant_model=draft),
        "hf_assisted_heuristic": lambda p: hf(p, assistant_model=draft,
                                              num_assistant_tokens_schedule="heuristic",
                                              num_assistant_tokens=5),
        "hf_early_exit": lambda p: hf(p, assistant_early_exit=layers),
        "rag_spec_no_drafts": decoder(budget=0),
        "rag_spec_trie": decoder(),
        "rag_spec_draft_chain": decoder(DraftModelDrafter(
            draft, expansion=Expansion(widths=(1,), max_depth=4))),
        "rag_spec_draft_tree": decoder(DraftModelDrafter(draft)),
        "rag_spec_early_exit": decoder(EarlyExitDrafter(layers)),
        "rag_spec_trained_exit": decoder(EarlyExitDrafter(layers, adapter=adapter)),
        "rag_spec_draft_head": decoder(FeatureDrafter(head)),
        "rag_spec_merged": decoder(MergedDrafter(DraftModelDrafter(draft))),
        "rag_spec_merged_trained_exit": decoder(MergedDrafter(
            EarlyExitDrafter(layers, adapter=adapter))),
        "rag_spec_merged_draft_head": decoder(MergedDrafter(FeatureDrafter(head))),
    }


def _plot(report: dict[str, Any], path: Path) -> None:
    panels = [(mode, name) for mode in _modes(report) for name in report[mode]]
    fig, axes = figure(len(panels), (5 * len(panels), 5), sharey=True, squeeze=False)
    for ax, (mode, name) in zip(axes[0], panels):
        data = report[mode][name]["systems"]
        ax.boxplot([data[s]["per_prompt_speedup"] for s in data], tick_labels=list(data))
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.tick_params(axis="x", rotation=60)
        ax.set_title(f"{mode}, {name}")
        ax.set_ylabel("speedup vs transformers (per prompt)")
    save_figure(fig, path, f"{describe(report)}; draft: {report['draft']}, "
                           f"{report['max_new_tokens']} new tokens")


def _print_table(report: dict[str, Any]) -> None:
    for mode in _modes(report):
        for name, summary in report[mode].items():
            print(f"\n{mode}, {name} ({summary['prompts']} prompts)")
            print(f"{'system':24} {'tok/s':>7} {'vs hf':>7} {'vs assisted':>12} "
                  f"{'tok/step':>9} {'identical':>10}")
            for system, s in summary["systems"].items():
                print(f"{system:24} {s['tok_per_s']:7.1f} {s['speedup_vs_hf']:6.2f}x "
                      f"{s.get('speedup_vs_hf_assisted', float('nan')):11.2f}x "
                      f"{s.get('tokens_per_step', 1.0):9.2f} "
                      f"{s.get('identical_to_hf', '-')!s:>10}")


def _modes(report: dict[str, Any]) -> list[str]:
    """The report's runs, in the order they ran."""
    return [key for key in report
            if key in ("greedy", "sampling") or key.startswith("greedy_batch")]
