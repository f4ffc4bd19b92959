"""``rag-spec bench ralm``: the naive iterative RaLM loop against speculative retrieval and
each of its parts, interleaved per question, with identical outputs checked; with ``served``,
both loops drive a model behind an OpenAI-compatible server (``ServedModel``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from rag_spec.bench.prompts import RAG_QUESTIONS, load_questions
from rag_spec.bench.report import (
    Run,
    dequantized,
    interleaved,
    loop_summary,
    machine,
    median,
    print_loop_table,
    publish,
    rss_mb,
    speedup_bars,
)

# name -> (prefetch, os3, asynchronous, lookahead decoding, search only); None = the naive loop.
# "Search only" hides everything but ``search`` (and hits' vectors), as a user's own client
# would: guesses are then scored by embedding the cached passages here.
SYSTEMS: dict[str, tuple[int, bool, bool, bool, bool] | None] = {
    "naive": None,
    "spec": (1, False, False, False, False),
    "spec_prefetch": (20, False, False, False, False),
    "spec_os3": (1, True, False, False, False),
    "spec_async": (1, False, True, False, False),
    "spec_all": (20, True, True, False, False),
    "spec_all_search_only": (20, True, True, False, True),
    "spec_all_lookahead": (20, True, True, True, False),
}
RETRIEVERS = {"exact": "flat", "hnsw": "hnsw", "ivf": "ivf", "bm25": "bm25", "milvus": "milvus"}


def run(retriever: str = "exact", kb_size: int | None = None, latency_ms: float = 0.0,
        packed: bool = False, questions_file: str | None = None, json_out: str | None = None,
        limit: int | None = 6, max_new_tokens: int = 64, stride: int = 4,
        uri: str | None = None, served: str | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table; write JSON and a PNG; return the report.

    ``retriever="milvus"`` searches the default corpus in Milvus at ``uri`` (default: the
    local milvus-lite folder, a real loopback round trip); ``latency_ms`` adds to any kind.
    ``served``: the address of a server of the embedded model (``rag-spec serve``) that both
    loops drive instead of a model in this process (lookahead decoding is then the server's)."""

    from rag_spec.bench.simulated import DelayedRetriever, SearchOnly
    from rag_spec.engine.decoder import LookaheadDecoder
    from rag_spec.models import load_model
    from rag_spec.retrieval import KnowledgeBase
    from rag_spec.retrieval.milvus import MilvusKnowledgeBase
    from rag_spec.retrieval.spec_retriever import SpecRetriever
    from rag_spec.serving.ralm import IterativeRaLM, RaLMSpeculation
    from rag_spec.serving.served_model import ServedModel

    questions = load_questions(questions_file) if questions_file else RAG_QUESTIONS
    questions = questions[:limit]
    lm = ServedModel(served) if served else load_model()
    kb = (MilvusKnowledgeBase.open(uri=uri) if retriever == "milvus"
          else KnowledgeBase.load_default(RETRIEVERS[retriever]))
    real = len(kb)
    if kb_size and kb_size > real:
        kb = with_distractors(kb, kb_size)
    if packed:
        started = time.perf_counter()
        kb.pack()
        print(f"packed {len(kb)} vectors in {time.perf_counter() - started:.0f} s")
    base = DelayedRetriever(kb, latency_ms) if latency_ms else kb
    distractor_wins = sum(h[0].doc_id >= real for h in kb.search(questions, k=1))

    # on the float32 weights the naive loop's one-token steps decode, so that the lookahead
    # system's tokens are comparable with the naive loop's (a GGUF-loaded model's default
    # decoder would decode the file's weights)
    decoder = None if served else LookaheadDecoder(lm.model, lm.tokenizer, dequantized())
    systems = {name: s for name, s in SYSTEMS.items() if not (served and s and s[3])}
    cold = bool(served) and lm.reset_prefix_cache()  # the server can empty its prefix cache

    def system(settings: tuple[int, bool, bool, bool, bool] | None) -> Any:
        # One loop per system, as an application keeps one: OS3 starts cold only once.
        retriever_ = base if settings is None else SpecRetriever(
            SearchOnly(base) if settings[4] else base, prefetch=settings[0])
        ralm = IterativeRaLM(lm, retriever_, stride=stride,
                             lookahead=decoder if settings and settings[3] else None,
                             speculation=RaLMSpeculation(
                                 os3=bool(settings and settings[1]),
                                 asynchronous=bool(settings and settings[2])))

        def one(question: str) -> Run:
            if cold:  # every run from a cold prefix cache: no system reads another's prompts
                lm.reset_prefix_cache()
            result = ralm.generate(question, max_new_tokens=max_new_tokens)
            return Run(0.0, result.token_ids, {"stats": result.stats})
        return one

    deterministic = None
    if served:  # a server that batches may round otherwise run to run: then no identity holds
        twice = [system(None)(questions[0]).tokens for _ in range(2)]
        deterministic = twice[0] == twice[1]
        if not deterministic:
            print("the server's greedy answer changed between two identical naive runs: "
                  "'identical' below compares against a reference that is not one")
    runs = interleaved({name: system(s) for name, s in systems.items()}, questions)
    naive = runs["naive"]
    share = median([r.extra["stats"].retrieval_seconds / r.seconds for r in naive])
    report: dict[str, Any] = {
        "benchmark": "ralm", "questions": len(questions), "retriever": retriever,
        "kb_size": len(kb), "real_passages": real, "distractor_top1_wins": distractor_wins,
        "latency_ms": latency_ms, "packed": packed, "stride": stride, "served": bool(served),
        # served: whether the server's prefix cache was emptied before every run
        "cold_prefix_cache": cold,
        "server_deterministic": deterministic,  # two naive runs of one question agreed
        "max_new_tokens": max_new_tokens,
        "retrieval_share": round(share, 3), "amdahl_bound": round(1 / max(1 - share, 1e-9), 3),
        "rss_mb": round(rss_mb(), 1), "machine": machine(), "systems": {}}
    for name, system_runs in runs.items():
        report["systems"][name] = {
            "seconds_per_request": round(median([r.seconds for r in system_runs]), 3),
            **loop_summary(naive, system_runs),
            "waiting_seconds": round(median([r.extra["stats"].waiting_seconds
                                             for r in system_runs]), 3),
            "per_question_speedup": [round(n.seconds / r.seconds, 3)
                                     for n, r in zip(naive, system_runs)]}
        if served:  # the prompt tokens the strides sent, those the server read, not computed,
            # and the strides closed mid-stream on a wrong guess found behind them
            report["systems"][name].update({
                key: round(median([getattr(r.extra["stats"], f"served_{key}")
                                   for r in system_runs]), 1)
                for key in ("prompt_tokens", "cached_tokens", "cancelled_strides")})
    name = f"ralm_{retriever}" + (f"_{kb_size}" if kb_size else "") + (
        "_packed" if packed else "") + (f"_{int(latency_ms)}ms" if latency_ms else "") + (
        "_served" if served else "")
    publish(report, json_out, name, _plot, _print_table)
    return report


def with_distractors(kb: Any, size: int, seed: int = 0) -> Any:
    """The same knowledge base padded to ``size`` passages with random unit vectors, labelled
    as distractors; real passages keep their ids. Exact (flat) indexes only."""
    import faiss

    from rag_spec.corpus import Passage
    from rag_spec.retrieval import KnowledgeBase
    from rag_spec.retrieval.indexes import DenseIndex

    real = kb.index.cpu_index
    vectors = real.reconstruct_n(0, real.ntotal)
    index = faiss.IndexFlatIP(vectors.shape[1])
    index.add(vectors)
    rng = np.random.default_rng(seed)
    started = time.perf_counter()
    for done in range(real.ntotal, size, 500_000):
        block = rng.standard_normal((min(500_000, size - done), vectors.shape[1]),
                                    dtype=np.float32)
        block /= np.linalg.norm(block, axis=1, keepdims=True)
        index.add(block)
    print(f"added {size - real.ntotal} distractors in {time.perf_counter() - started:.0f} s")
    distractor = Passage("distractor", "(random vector, no text)")
    passages = kb.passages + [distractor] * (size - real.ntotal)
    return KnowledgeBase(passages, DenseIndex("flat", index, kb.index.embedder))


def _plot(report: dict[str, Any], path: Path) -> None:
    speedup_bars(report, path, "RaLM",
                 f"{report['retriever']}{' (packed)' if report.get('packed') else ''}, "
                 f"{report['kb_size']} passages, {report['latency_ms']:.0f} ms latency, "
                 f"retrieval share {report['retrieval_share']:.2f}")


def _print_table(report: dict[str, Any]) -> None:
    print_loop_table(report, f"retriever {report['retriever']}, kb {report['kb_size']}, "
                     f"latency {report['latency_ms']} ms", "seconds_per_request", "questions")
