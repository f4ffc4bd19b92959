"""``rag-spec bench serve``: ``rag-spec serve`` under 1, 4, 8 and 16 concurrent clients (the
``openai`` SDK, one thread each) on held-out RAG questions, greedy: aggregate tokens per
second, p50 / p95 latency of whole answers, and time to first token of streamed ones, against
the same requests sent one at a time; every answer compared with its answer alone.

Streamed answers hold the model while they stream (``LocalLM.stream``), so concurrent streams
queue: their time to first token shows it. Whole answers that arrive together with the same
settings decode as one batch. llama.cpp's server is the peer where llama-cpp-python's
``[server]`` extra is installed; without it the report says so.
"""

from __future__ import annotations

import importlib.util
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rag_spec import KnowledgeBase, Server, rag_messages
from rag_spec.bench.prompts import HELD_OUT_RAG_QUESTIONS
from rag_spec.bench.report import figure, machine, median, publish, save_figure

MODEL = "smollm2-135m-instruct"


def run(json_out: str | None = None, clients: tuple[int, ...] = (1, 4, 8, 16),
        max_new_tokens: int = 64) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON and a PNG plot; return the report."""
    import openai

    questions = list(HELD_OUT_RAG_QUESTIONS)
    hits = KnowledgeBase.load_default("flat").search(questions, k=3)
    requests = [rag_messages(q, h) for q, h in zip(questions, hits)]
    report: dict[str, Any] = {"model": MODEL, "max_new_tokens": max_new_tokens,
                              "questions": len(requests), "machine": machine(), "levels": [],
                              "llama_cpp_server": "not installed (pip install "
                              "'llama-cpp-python[server]' to measure it)"
                              if importlib.util.find_spec("llama_cpp") is None else
                              "installed, not yet run by this bench"}
    with Server(MODEL) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)

        def answer(messages: Any) -> tuple[float, str, int]:
            started = time.perf_counter()
            reply = client.chat.completions.create(model=MODEL, messages=messages,
                                                   max_tokens=max_new_tokens, temperature=0)
            return (time.perf_counter() - started, reply.choices[0].message.content or "",
                    reply.usage.completion_tokens)

        def first_token(messages: Any) -> float:
            started = time.perf_counter()
            stream = client.chat.completions.create(model=MODEL, messages=messages,
                                                    max_tokens=max_new_tokens, temperature=0,
                                                    stream=True)
            waited = None
            for chunk in stream:
                if waited is None and chunk.choices and chunk.choices[0].delta.content:
                    waited = time.perf_counter() - started
            return waited if waited is not None else time.perf_counter() - started

        answer(requests[0])  # first-use costs off the clock
        alone = [answer(r) for r in requests]  # one at a time: the reference
        for level in clients:
            with ThreadPoolExecutor(level) as pool:
                started = time.perf_counter()
                together = list(pool.map(answer, requests))
                wall = time.perf_counter() - started
                waits = list(pool.map(first_token, requests[:level]))
            tokens = sum(t for _, _, t in together)
            latencies = sorted(s for s, _, _ in together)
            report["levels"].append({
                "clients": level, "tok_per_s": round(tokens / wall, 2),
                "p50_seconds": round(median(latencies), 3),
                "p95_seconds": round(latencies[int(0.95 * (len(latencies) - 1))], 3),
                "ttft_p50_seconds": round(median(waits), 3),
                "ttft_p95_seconds": round(sorted(waits)[int(0.95 * (len(waits) - 1))], 3),
                "identical_to_alone": sum(a[1] == t[1] for a, t in zip(alone, together))})
    one = report["levels"][0]["tok_per_s"]
    for level in report["levels"]:
        level["speedup"] = round(level["tok_per_s"] / one, 3)
    publish(report, json_out, "serve", _plot, _print_table)
    return report


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, ax = figure()
    levels = report["levels"]
    ax.plot([x["clients"] for x in levels], [x["tok_per_s"] for x in levels], marker="o")
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("aggregate tokens/s")
    save_figure(fig, path, f"rag-spec serve: {report['questions']} held-out RAG questions")


def _print_table(report: dict[str, Any]) -> None:
    print(f"{'clients':>7} {'tok/s':>8} {'x one':>6} {'p50 s':>6} {'p95 s':>6} "
          f"{'ttft p50':>8} {'identical':>9}")
    for x in report["levels"]:
        print(f"{x['clients']:>7} {x['tok_per_s']:>8.1f} {x['speedup']:>5.2f}x "
              f"{x['p50_seconds']:>6.2f} {x['p95_seconds']:>6.2f} {x['ttft_p50_seconds']:>8.2f} "
              f"{x['identical_to_alone']:>5}/{report['questions']}")
    print(f"llama.cpp's server: {report['llama_cpp_server']}")
