"""``rag-spec bench lookahead``: our decoder against transformers greedy and prompt lookup.

Systems run interleaved on each prompt, all greedy, same model, dtype and device: transformers
greedy and its prompt lookup (the peers), ours, and three ablations of ours (no drafts: the
same kernels without speculation; no memory: the trie forgetting earlier answers, beside the
ceiling of copying from each prompt and its answer; in float32, stock linear kernels:
speculation without ours; in half precision, where ours runs exact numerics, the fast kernels:
what exactness costs, and that without it tokens differ); where our streamed kernel runs
(float32, AVX-512 or AVX2), ours on oneDNN's kernels instead (what that kernel buys); where this
machine holds the model's steps compiled ahead of time (the default then runs them), ours with
eager steps (what they buy); with ``--compiled``, ours with compiled steps, drafting and not;
with ``--draft-head``, ours drafting with the trained draft head (``draft_head.cached_head``),
alone and merged with the trie, eager and, with ``--compiled``, compiled. Outputs are
compared token for token with transformers greedy; where one differs, the report gives the
position and the baseline's top-2 logit margin there, so a real bug never hides as "numerics".
Every system above runs the model's own (float32 or bfloat16) weights, as ``generate`` does.

``--peer llama.cpp``, for a model loaded from a GGUF file: our decoding of the file's own
weights (the default on a CPU), drafting and not, and plain llama.cpp greedy decoding of the
same file at 1 and 2 threads (the faster is the peer: ``gguf`` in the report, its
``speedup_vs_llama_cpp``); these are compared with our no-draft decoding of the file, not with
``generate``, and llama.cpp's own greedy tokens are reported, for information, against it.
"""

from __future__ import annotations

import ctypes
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from rag_spec.bench.ceiling import copy_ceiling
from rag_spec.bench.prompts import OPEN_PROMPTS, RAG_QUESTIONS, load_questions
from rag_spec.bench.report import (
    Run,
    dequantized,
    figure,
    gpu_projection,
    interleaved,
    machine,
    median,
    peak_rss_mb,
    publish,
    reset_peak_rss,
    rss_mb,
    runs_pass_statistics,
    save_figure,
    setting,
)


def run(prompts_file: str | None = None, json_out: str | None = None, max_new_tokens: int = 128,
        limit: int | None = None, model_name: str = "smollm2-135m-instruct",
        dtype: str = "float32", compiled: bool = False, draft_head: bool = False,
        peer: str | None = None) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON and a PNG plot; return the report.
    ``compiled`` adds our decoder with compiled steps, drafting and not (its warm-up, which
    compiles, is reported as ``warm_up_s``); ``draft_head`` our decoder drafting with the
    draft head (shipped for the embedded model, else trained the first time: about an hour and a
    half), alone and merged with the trie, with compiled steps too."""
    from rag_spec.drafters.feature_drafter import FeatureDrafter
    from rag_spec.drafters.merged_drafter import MergedDrafter
    from rag_spec.drafters.trie_drafter import TrieDrafter
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder, ablated
    from rag_spec.models import load_model
    from rag_spec.training.train_head import cached_head

    questions = (load_questions(prompts_file) if prompts_file else RAG_QUESTIONS)[:limit]
    lm = load_model(model_name, dtype=dtype)
    rag, open_ended = prompt_sets(lm.tokenizer, questions, limit)
    decoder = LookaheadDecoder(lm.model, lm.tokenizer, dequantized())
    # The ablations: the same kernels drafting nothing (what speculation buys), and the same
    # decoder on the stock linear kernels (what our kernels buy) or, where ours is exact, on
    # the fast ones (what exactness costs).
    plain = LookaheadDecoder(lm.model, lm.tokenizer, dequantized(budget=0))
    ablation, config = ("rag_spec_fast_kernels", dequantized(exact=False)) \
        if decoder.runner.exact else ("rag_spec_stock_linear", dequantized(onednn_linear=False))
    # and the trie without its memory of earlier answers: what copying from each prompt and
    # its answer alone gives, beside that ceiling (``copy_ceiling_tokens_per_step``)
    decoders = {"rag_spec": decoder, "rag_spec_no_drafts": plain,
                "rag_spec_no_memory": LookaheadDecoder(lm.model, lm.tokenizer,
                                                       dequantized(memory_mb=0)),
                ablation: LookaheadDecoder(lm.model, lm.tokenizer, config)}
    if decoder.drafter.label != TrieDrafter.label:  # the default drafts with a shipped head
        decoders["rag_spec_trie"] = LookaheadDecoder(lm.model, lm.tokenizer, dequantized(),
                                                     drafter=TrieDrafter())
    if decoder.runner.compiled is not None:  # steps compiled ahead of time: and eager ones
        decoders["rag_spec_eager"] = LookaheadDecoder(lm.model, lm.tokenizer,
                                                      dequantized(compile=False))
    if any(stack.streamed for stack in decoder.runner.stacks):  # and on oneDNN's kernels
        decoders["rag_spec_onednn"] = ablated(lm.model, lm.tokenizer, dequantized(),
                                              streamed_linear=False)
    if compiled:
        decoders.update({f"rag_spec_compiled{suffix}": LookaheadDecoder(
            lm.model, lm.tokenizer, dequantized(budget=budget, exact=False, compile=True))
            for suffix, budget in (("", LookaheadConfig.budget), ("_no_drafts", 0))})
    if draft_head:  # alone, and merged with the trie
        head = cached_head(lm, train=False)  # trained by `rag-spec draft train --head`
        configs = {"rag_spec": dequantized()}
        if compiled:
            configs["rag_spec_compiled"] = dequantized(exact=False, compile=True)
        for name, config in configs.items():
            decoders[f"{name}_draft_head"] = LookaheadDecoder(
                lm.model, lm.tokenizer, config, drafter=FeatureDrafter(head))
            decoders[f"{name}_draft_head_trie"] = LookaheadDecoder(
                lm.model, lm.tokenizer, config, drafter=MergedDrafter(FeatureDrafter(head)))
    systems = _systems(lm.model, decoders, max_new_tokens)
    gguf = _gguf_systems(lm, max_new_tokens) if peer == "llama.cpp" else {}
    systems.update(gguf)
    report: dict[str, Any] = {"benchmark": "lookahead", "model": model_name,
                              "dtype": str(lm.dtype), "exact": decoder.runner.exact,
                              "default_drafts": decoder.drafter.label,
                              "default_passes": "eager" if decoder.runner.compiled is None
                              else decoder.runner.compiled.kind,
                              "max_new_tokens": max_new_tokens,
                              "warm_up_s": _warm_up(systems, rag[0]), "machine": machine()}
    for name, prompts in (("rag", rag), ("open_ended", open_ended)):
        print(f"{name}: {len(prompts)} prompts")
        runs = interleaved(systems, prompts)
        summary = _summarise(lm.model, prompts, {n: r for n, r in runs.items() if n not in gguf})
        if gguf:
            summary["gguf"] = _summarise_gguf({n: runs[n] for n in gguf})
        if name == "rag":  # the top-level keys DESIGN.md names are the RAG set's
            report.update({k: v for k, v in summary.items() if k != "gguf"})
        report[name] = summary
    trie = decoder.drafter if isinstance(decoder.drafter, TrieDrafter) else \
        decoders.get("rag_spec_trie", decoder).drafter
    report["trie_memory_nodes"] = trie.memory.nodes
    report["onednn_copy_mb"] = round(decoder.runner.extra_bytes / 2**20, 1)
    publish(report, json_out, "lookahead", _plot, _print_table)
    return report


def prompt_sets(tokenizer: Any, questions: list[str], limit: int | None,
                open_prompts: list[str] = OPEN_PROMPTS) -> tuple[list[list[int]], list[list[int]]]:
    """Chat prompts: ``questions`` with their passages from the default knowledge base, and
    up to ``limit`` of ``open_prompts`` alone."""
    from rag_spec.prompts import chat_input_ids, rag_messages
    from rag_spec.retrieval import KnowledgeBase

    kb = KnowledgeBase.load_default("flat")
    hits = kb.search(questions, k=3)
    rag = [chat_input_ids(tokenizer, rag_messages(q, h)) for q, h in zip(questions, hits)]
    open_ended = [chat_input_ids(tokenizer, [{"role": "user", "content": p}])
                  for p in open_prompts[:limit]]
    return rag, open_ended


def _systems(model: Any, decoders: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    def hf(prompt: list[int], **kwargs: Any) -> Run:
        ids = torch.tensor([prompt], device=model.device)
        reset_peak_rss()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, **kwargs)
        return Run(0.0, out[0, len(prompt):].tolist(), {"rss_mb": rss_mb(),
                                                          "peak_rss_mb": peak_rss_mb()})

    systems: dict[str, Any] = {"hf": hf,
                               "pld4": lambda p: hf(p, prompt_lookup_num_tokens=4),
                               "pld10": lambda p: hf(p, prompt_lookup_num_tokens=10)}
    for name, decoder in decoders.items():
        systems[name] = lambda p, d=decoder: _ours(d, p, max_new_tokens)
    return systems


def _ours(decoder: Any, prompt: list[int], max_new_tokens: int) -> Run:
    reset_peak_rss()
    result = decoder.generate(prompt, max_new_tokens=max_new_tokens)
    return Run(0.0, result.token_ids, {"stats": [result.stats],
                                       "rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb()})


def _gguf_systems(lm: Any, max_new_tokens: int) -> dict[str, Any]:
    """Our decoding of the model's GGUF file's weights, drafting and not, and plain llama.cpp
    on the file at 1 and 2 threads; none (saying why in one line) where the model came from
    no GGUF file or llama-cpp-python is not installed."""
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder
    from rag_spec.target.gguf import source_file

    path = source_file(lm.model)
    if path is None:
        print("--peer llama.cpp: the model was not loaded from a GGUF file (the embedded "
              "model is; or --model x.gguf): llama.cpp is left out")
        return {}
    try:
        import llama_cpp
    except ImportError:
        print("--peer llama.cpp: llama-cpp-python is not installed (pip install "
              "llama-cpp-python): llama.cpp is left out")
        return {}
    systems: dict[str, Any] = {}
    for name, config in (("gguf_rag_spec", LookaheadConfig(quantized=True)),
                         ("gguf_rag_spec_no_drafts", LookaheadConfig(quantized=True, budget=0))):
        decoder = LookaheadDecoder(lm.model, lm.tokenizer, config)
        systems[name] = lambda p, d=decoder: _ours(d, p, max_new_tokens)
    eos = lm.tokenizer.eos_token_id

    def plain(prompt: list[int], peer: LlamaCpp) -> Run:
        reset_peak_rss()
        tokens = peer.greedy(prompt, max_new_tokens, eos)
        return Run(0.0, tokens, {"rss_mb": rss_mb(), "peak_rss_mb": peak_rss_mb()})

    for threads in (1, 2):
        peer = LlamaCpp(llama_cpp, path, threads)
        systems[f"gguf_llama_cpp_{threads}_thread{'s' * (threads > 1)}"] = (
            lambda p, d=peer: plain(p, d))
    return systems


class LlamaCpp:
    """Plain greedy decoding of a GGUF file by llama.cpp, through llama-cpp-python's low-level
    API: its ``Llama`` class cannot turn off the repacked weights, whose path crashes on the
    AMX Xeon VMs on prompts longer than one token. One-token steps run on ``threads`` threads,
    a prompt on every core (llama-cpp-python's defaults for the rest)."""

    def __init__(self, lib: Any, path: Any, threads: int) -> None:
        import os

        self.lib = lib
        lib.llama_log_set(_QUIET, ctypes.c_void_p(0))
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.use_extra_bufts = False
        self.model = lib.llama_model_load_from_file(str(path).encode(), params)
        context = lib.llama_context_default_params()
        context.n_ctx, context.n_batch, context.n_ubatch = 8192, 4096, 512
        context.n_threads, context.n_threads_batch = threads, os.cpu_count() or 1
        self.ctx = lib.llama_init_from_model(self.model, context)
        self.vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model))
        weakref.finalize(self, _free, lib, self.ctx, self.model)

    def greedy(self, prompt: list[int], max_new_tokens: int, eos: int | None) -> list[int]:
        """Up to ``max_new_tokens`` greedy tokens after ``prompt``, ending with ``eos``."""
        import numpy as np

        lib = self.lib
        lib.llama_memory_clear(lib.llama_get_memory(self.ctx), True)
        out: list[int] = []
        feed = prompt
        while len(out) < max_new_tokens:
            tokens = (lib.llama_token * len(feed))(*feed)
            if lib.llama_decode(self.ctx, lib.llama_batch_get_one(tokens, len(feed))) != 0:
                msg = "llama.cpp could not decode a batch (llama_decode failed)"
                raise RuntimeError(msg)
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.ctx, -1),
                                           shape=(self.vocab,))
            out.append(int(logits.argmax()))
            if out[-1] == eos:
                break
            feed = out[-1:]
        return out


def _free(lib: Any, ctx: Any, model: Any) -> None:
    lib.llama_free(ctx)
    lib.llama_model_free(model)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level: int, text: bytes, data: Any) -> None:  # noqa: N802 - llama.cpp's log, dropped
    return None


def _summarise_gguf(runs: dict[str, list[Run]]) -> dict[str, Any]:
    """The GGUF file's systems: tok/s, each one's median per-prompt tok/s ratio over plain
    llama.cpp at its faster thread count (the peer) and over our no-draft decoding of the
    file, and how many answers equal the latter's."""
    rates = {n: [len(r.tokens) / r.seconds for r in rs] for n, rs in runs.items()}
    threads = [n for n in runs if "llama_cpp" in n]
    peer = max(threads, key=lambda n: median(rates[n]))
    reference = runs["gguf_rag_spec_no_drafts"]
    systems = {}
    for name, system_runs in runs.items():
        entry = {"tok_per_s": round(median(rates[name]), 2),
                 "speedup_vs_llama_cpp": round(median(
                     [a / b for a, b in zip(rates[name], rates[peer])]), 3),
                 "speedup_vs_no_drafts": round(median(
                     [a / b for a, b in zip(rates[name], rates["gguf_rag_spec_no_drafts"])]), 3),
                 "identical_to_no_drafts": sum(r.tokens == b.tokens
                                               for r, b in zip(system_runs, reference)),
                 "peak_rss_mb": round(max(r.extra["peak_rss_mb"] for r in system_runs), 1)}
        entry.update(runs_pass_statistics(system_runs))
        systems[name] = entry
    return {"peer": peer, "systems": systems}


def _warm_up(systems: dict[str, Any], prompt: list[int]) -> dict[str, float]:
    """Run every system once on a short prompt; the seconds each took."""
    seconds = {}
    for name, system in systems.items():
        started = time.perf_counter()
        system(prompt[:64])
        seconds[name] = round(time.perf_counter() - started, 2)
    return seconds


def _summarise(model: Any, prompts: Sequence[list[int]], runs: dict[str, list[Run]]
               ) -> dict[str, Any]:
    """Each system against transformers greedy, and the ceiling of copying (``copy_ceiling``,
    drafts as long as the default trie's) on the baseline's answers; with tokens per pass,
    what a GPU user would keep (``gpu_projection``)."""
    from rag_spec.engine.decoder import LookaheadConfig

    baseline = runs["hf"]
    systems: dict[str, Any] = {}
    for name, system_runs in runs.items():
        speedups = [b.seconds / r.seconds * len(r.tokens) / max(len(b.tokens), 1)
                    for b, r in zip(baseline, system_runs)]
        divergences = [_divergence(model, p, b.tokens, r.tokens)
                       for p, b, r in zip(prompts, baseline, system_runs) if r.tokens != b.tokens]
        entry = {"tok_per_s": round(median([len(r.tokens) / r.seconds for r in system_runs]), 2),
                 "speedup_vs_hf": round(median(speedups), 3),
                 "min_speedup_vs_hf": round(min(speedups), 3),
                 "identical_to_hf": len(prompts) - len(divergences),
                 "per_prompt_speedup": [round(s, 3) for s in speedups],
                 "divergences": divergences}
        # The process's resident memory after each of the system's runs, and its peak during
        # them (one process holds every system: the model and each runner's copies count).
        entry["rss_mb"] = round(max(r.extra["rss_mb"] for r in system_runs), 1)
        entry["peak_rss_mb"] = round(max(r.extra["peak_rss_mb"] for r in system_runs), 1)
        entry.update(runs_pass_statistics(system_runs))
        if "tokens_per_step" in entry:
            projection = gpu_projection(entry["tokens_per_step"], 1 + LookaheadConfig.budget)
            if projection is not None:
                entry["gpu_projection"] = projection
        systems[name] = entry
    def over(other: str) -> float:  # the default's median per-prompt ratio to ``other``
        return round(median([a / b for a, b in zip(systems["rag_spec"]["per_prompt_speedup"],
                                                   systems[other]["per_prompt_speedup"])]), 3)

    ceiling = [copy_ceiling(p, b.tokens) for p, b in zip(prompts, baseline)]
    summary = {"prompts": len(prompts), "systems": systems,
               "rag_spec_over_no_drafts": over("rag_spec_no_drafts"),
               "copy_ceiling_tokens_per_step": round(sum(ceiling) / len(ceiling), 3)}
    if "rag_spec_eager" in systems:  # what the steps compiled ahead of time buy
        summary["rag_spec_over_eager"] = over("rag_spec_eager")
    return summary


def _divergence(model: Any, prompt: list[int], expected: list[int], got: list[int]
                ) -> dict[str, Any]:
    """Where two greedy outputs part, and how close the baseline's top two logits were there."""
    position = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
                    min(len(expected), len(got)))
    context = torch.tensor([prompt + expected[:position]], device=model.device)
    with torch.inference_mode():
        top2 = model(context).logits[0, -1].float().topk(2).values
    return {"position": position, "baseline_top2_margin": round(float(top2[0] - top2[1]), 6),
            "expected_len": len(expected), "got_len": len(got)}


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, axes = figure(2, (13, 5.5), sharey=True)
    for ax, name in zip(axes, ("rag", "open_ended")):
        data = report[name]["systems"]
        labels = [system.removeprefix("rag_spec_") for system in data]  # short, so they fit
        ax.boxplot([s["per_prompt_speedup"] for s in data.values()], tick_labels=labels)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.tick_params(axis="x", rotation=60)
        for label in ax.get_xticklabels():
            label.set_horizontalalignment("right")
        ax.set_title(f"{name}: {report[name]['prompts']} prompts "
                     f"(rag_spec median {data['rag_spec']['speedup_vs_hf']:.2f}x)")
        ax.set_ylabel("speedup vs transformers greedy (per prompt)")
    save_figure(fig, path, f"{setting(report)}, {report['max_new_tokens']} new tokens")


def _print_table(report: dict[str, Any]) -> None:
    for name in ("rag", "open_ended"):
        n = report[name]["prompts"]
        print(f"\n{name} ({n} prompts): copying from each prompt and its answer reaches at "
              f"most {report[name]['copy_ceiling_tokens_per_step']:.2f} tokens per step (the "
              "trie's memory of earlier answers can add to that)")
        print(f"{'system':22} {'tok/s':>7} {'speedup':>8} {'min':>6} {'identical':>10} "
              f"{'peak RSS':>9} {'tok/pass':>9} {'GPU proj.':>10}")
        for system, s in report[name]["systems"].items():
            projection = s.get("gpu_projection")
            print(f"{system:22} {s['tok_per_s']:7.1f} {s['speedup_vs_hf']:7.2f}x "
                  f"{s['min_speedup_vs_hf']:5.2f}x {s['identical_to_hf']:>5}/{n} "
                  f"{s['peak_rss_mb'] / 1024:8.2f}G {s.get('tokens_per_step', 1.0):9.2f} "
                  + (f"{projection['speedup_vs_no_drafts']:9.2f}x" if projection else ""))
        print("GPU proj.: tokens per pass over a tree step's cost against a plain step on a GPU "
              "(make gpu-check's report): the speedup over our no-draft decoder a GPU user keeps")
        gguf = report[name].get("gguf")
        if gguf:
            print(f"\nthe GGUF file's weights (peer: {gguf['peer']}):")
            print(f"{'system':26} {'tok/s':>7} {'vs llama.cpp':>13} {'vs no drafts':>13} "
                  f"{'identical':>10} {'peak RSS':>9}")
            for system, s in gguf["systems"].items():
                print(f"{system:26} {s['tok_per_s']:7.1f} {s['speedup_vs_llama_cpp']:12.3f}x "
                      f"{s['speedup_vs_no_drafts']:12.3f}x {s['identical_to_no_drafts']:>6}/{n} "
                      f"{s['peak_rss_mb'] / 1024:8.2f}G")
