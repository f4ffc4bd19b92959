"""``rag-spec bench serve``: ``rag-spec serve`` under 1, 4, 8 and 16 concurrent clients (the
``openai`` SDK, one thread each) on held-out RAG questions, greedy: aggregate tokens per
second, p50 / p95 latency of whole answers, and time to first token of streamed ones, against
the same requests sent one at a time; every answer compared with its answer alone.

Every request, streamed or not, joins the batch in flight at its next step (continuous
batching). llama.cpp's server (llama-cpp-python's ``[server]`` extra, on the same GGUF file)
is the peer where it is installed: at 1 and 2 threads for one client, then at the faster for
the other levels, run after ours (two servers on 2 cores would slow each other); without it
the report says so.
"""

from __future__ import annotations

import contextlib
import importlib.util
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from rag_spec import KnowledgeBase, Server, load_model, rag_messages
from rag_spec.bench.prompts import HELD_OUT_RAG_QUESTIONS
from rag_spec.bench.report import figure, machine, median, publish, save_figure

MODEL = "smollm2-135m-instruct"
# llama.cpp's server is measured at these client counts (it decodes one request at a time)
PEER_CLIENTS = (1, 8)


def run(json_out: str | None = None, clients: tuple[int, ...] = (1, 4, 8, 16),
        max_new_tokens: int = 64) -> dict[str, Any]:
    """Run the benchmark, print a table, write JSON and a PNG plot; return the report."""
    questions = list(HELD_OUT_RAG_QUESTIONS)
    hits = KnowledgeBase.load_default("flat").search(questions, k=3)
    requests = [rag_messages(q, h) for q, h in zip(questions, hits)]
    report: dict[str, Any] = {"model": MODEL, "max_new_tokens": max_new_tokens,
                              "questions": len(requests), "machine": machine(), "levels": [],
                              "llama_cpp_server": "not installed (pip install "
                              "'llama-cpp-python[server]' to measure it)"}
    with Server(MODEL) as server:
        report["levels"] = _levels(server.url, requests, max_new_tokens, clients)
    one = report["levels"][0]["tok_per_s"]
    for level in report["levels"]:
        level["speedup"] = round(level["tok_per_s"] / one, 3)
    if _llama_cpp_server_installed():
        report["llama_cpp_server"] = _peer(requests, max_new_tokens,
                                           [c for c in PEER_CLIENTS if c in clients])
        peer = {x["clients"]: x["tok_per_s"] for x in report["llama_cpp_server"]["levels"]}
        for level in report["levels"]:
            if level["clients"] in peer:
                level["speedup_vs_llama_cpp"] = round(
                    level["tok_per_s"] / peer[level["clients"]], 3)
    publish(report, json_out, "serve", _plot, _print_table)
    return report


def _client(url: str, max_new_tokens: int) -> tuple[Callable[[Any], tuple[float, str, int]],
                                                     Callable[[Any], float]]:
    """A whole greedy answer (seconds, text, tokens) and a streamed one's time to its first
    text, through the ``openai`` SDK against the server at ``url``."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

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

    return answer, first_token


def _level(answer: Callable[[Any], tuple[float, str, int]], first_token: Callable[[Any], float],
           requests: list[Any], alone: list[tuple[float, str, int]], level: int
           ) -> dict[str, Any]:
    """Every request sent by ``level`` concurrent clients: aggregate tok/s, latencies, and
    answers against ``alone``; then ``level`` streams at once for their first text."""
    with ThreadPoolExecutor(level) as pool:
        started = time.perf_counter()
        together = list(pool.map(answer, requests))
        wall = time.perf_counter() - started
        waits = list(pool.map(first_token, requests[:level]))
    tokens = sum(t for _, _, t in together)
    latencies = sorted(s for s, _, _ in together)
    return {"clients": level, "tok_per_s": round(tokens / wall, 2),
            "p50_seconds": round(median(latencies), 3),
            "p95_seconds": round(latencies[int(0.95 * (len(latencies) - 1))], 3),
            "ttft_p50_seconds": round(median(waits), 3),
            "ttft_p95_seconds": round(sorted(waits)[int(0.95 * (len(waits) - 1))], 3),
            "identical_to_alone": sum(a[1] == t[1] for a, t in zip(alone, together))}


def _llama_cpp_server_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None
               for m in ("llama_cpp", "sse_starlette", "starlette_context"))


def _levels(url: str, requests: list[Any], max_new_tokens: int, clients: Any
            ) -> list[dict[str, Any]]:
    """The server at ``url`` at each client count, after a first request off the clock and
    every request alone (the reference its answers are compared with)."""
    answer, first_token = _client(url, max_new_tokens)
    answer(requests[0])  # first-use costs off the clock
    alone = [answer(r) for r in requests]  # one at a time: the reference
    return [_level(answer, first_token, requests, alone, level) for level in clients]


def _peer(requests: list[Any], max_new_tokens: int, clients: list[int]) -> dict[str, Any]:
    """llama.cpp's server on the embedded model's GGUF file: one client at 1 and 2 threads,
    then the other levels of ``clients`` at the faster."""
    from rag_spec.target.gguf import source_file

    path = source_file(load_model(MODEL).model)
    one = {}
    for threads in (1, 2):
        with _llama_cpp_server(path, threads) as url:
            one[threads] = _levels(url, requests, max_new_tokens, [1])[0]
    best = max(one, key=lambda t: one[t]["tok_per_s"])
    with _llama_cpp_server(path, best) as url:
        more = _levels(url, requests, max_new_tokens, [c for c in clients if c != 1])
    return {"threads": best, "one_client_tok_per_s_by_threads": {
        str(t): x["tok_per_s"] for t, x in one.items()},
        "levels": [one[best], *more] if 1 in clients else more}


@contextlib.contextmanager
def _llama_cpp_server(path: Path, threads: int) -> Iterator[str]:
    """``python -m llama_cpp.server`` on loopback, started and stopped here; yields its URL."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(path), "--model_alias", MODEL,
         "--host", "127.0.0.1", "--port", str(port), "--n_threads", str(threads),
         "--n_threads_batch", str(threads), "--n_ctx", "4096"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        for _ in range(600):  # loading takes seconds
            if server.poll() is not None:
                msg = f"llama.cpp's server exited at start (status {server.returncode})"
                raise RuntimeError(msg)
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        yield url
    finally:
        server.terminate()
        server.wait(30)


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, ax = figure()
    levels = report["levels"]
    ax.plot([x["clients"] for x in levels], [x["tok_per_s"] for x in levels], marker="o",
            label="rag-spec serve")
    peer = report["llama_cpp_server"]
    if not isinstance(peer, str):
        ax.plot([x["clients"] for x in peer["levels"]], [x["tok_per_s"] for x in peer["levels"]],
                marker="s", label=f"llama.cpp's server ({peer['threads']} threads)")
        ax.legend()
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
    peer = report["llama_cpp_server"]
    if isinstance(peer, str):
        print(f"llama.cpp's server: {peer}")
        return
    print(f"llama.cpp's server ({peer['threads']} thread{'s' * (peer['threads'] > 1)}):")
    for x in peer["levels"]:
        ours = next((o for o in report["levels"] if o["clients"] == x["clients"]), None)
        ratio = f" (rag-spec {ours['speedup_vs_llama_cpp']:.2f}x)" if ours else ""
        print(f"{x['clients']:>7} {x['tok_per_s']:>8.1f}{ratio}")
