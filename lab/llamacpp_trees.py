"""Our trie's drafts verified as token trees on llama.cpp's kernels: how fast, and lossless?

A prototype of what issue 86 asks the engine to do, outside the decode loop: the embedded Q4_1
GGUF through llama-cpp-python's low-level API, one context as llama-cpp-python sets it up on
this machine (one-token steps on ``cpu_count // 2`` threads, batches on all). Per prompt,
interleaved: plain one-token greedy decoding (the reference), then greedy decoding whose every
step verifies a tree the ``TrieDrafter`` proposed (prompt, passages, earlier answers) as one
``llama_batch``: a node carries the sequence ids of the leaves below it (each branch's
sequence starts as a copy of sequence 0, ``llama_memory_seq_cp``), and after the step every
branch's sequence is dropped (``llama_memory_seq_rm``); the accepted tokens are decoded again
at the head of the next step's batch, so that the answer's cells stay in position order.
Reports tok/s (prefill included), tokens per pass and whether the tokens equal the
reference's. Writes lab/results/llamacpp_trees.json.

Needs llama-cpp-python and the GGUF (see ``lab.llamacpp_numerics``).
``python -m lab.llamacpp_trees [BUDGET]``.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from lab import held_out_prompts, write_result
from lab.llamacpp_numerics import Context, _gguf
from rag_spec.bench.report import command_line, machine

NEW_TOKENS = 128


def plain(ctx: Context, prompt: list[int]) -> tuple[list[int], int]:
    out = [int(ctx.prefill(prompt).argmax())]
    while len(out) < NEW_TOKENS:
        at = len(prompt) + len(out) - 1
        out.append(int(ctx.decode([out[-1]], [at], [[0]], [True])[0].argmax()))
    return out, len(out) - 1


def speculative(ctx: Context, prompt: list[int], session: Any, budget: int
                ) -> tuple[list[int], int]:
    """Greedy decoding, each step one batch: the tokens committed since the last step (the
    accepted path and the newest token, whose cells were not kept) and the trie's tree after
    them. Only committed tokens' cells stay, appended in position order: a key's place in the
    cache is the order attention sums it in, so the answer's cells keep one-token decoding's
    order whatever branch was accepted."""
    out, passes = [int(ctx.prefill(prompt).argmax())], 0
    pending = [out[0]]  # committed, not yet in the cache
    session.observe(prompt + out, len(prompt))
    while len(out) < NEW_TOKENS:
        at = len(prompt) + len(out) - len(pending)  # the first pending token's position
        tree = session.propose(prompt + out, min(budget, NEW_TOKENS - len(out)))
        n = len(tree.tokens)
        children: list[list[int]] = [[] for _ in range(n)]
        for i, p in enumerate(tree.parents):
            if p >= 0:
                children[p].append(i)
        leaves = [i for i in range(n) if not children[i]]
        seq_of_leaf = {leaf: s for s, leaf in enumerate(leaves, 1)}
        below: list[set[int]] = [set() for _ in range(n)]
        for i in reversed(range(n)):  # parents come before children
            if i in seq_of_leaf:
                below[i].add(seq_of_leaf[i])
            if tree.parents[i] >= 0:
                below[tree.parents[i]] |= below[i]
        for s in range(1, len(leaves) + 1):  # every branch sees the answer so far
            ctx.lib.llama_memory_seq_cp(ctx.memory, 0, s, -1, -1)
        depths = [0] * n
        for i, p in enumerate(tree.parents):
            depths[i] = 1 if p < 0 else depths[p] + 1
        root_at = at + len(pending) - 1
        everyone = [0, *range(1, len(leaves) + 1)]
        logits = ctx.decode(
            [*pending, *tree.tokens],
            [at + j for j in range(len(pending))] + [root_at + d for d in depths],
            [everyone] * len(pending) + [sorted(b) for b in below],
            [False] * (len(pending) - 1) + [True] * (n + 1))
        passes += 1
        nxt, row, path = int(logits[0].argmax()), -1, []
        while True:  # follow the child that is the target's next token
            nodes = children[row] if row >= 0 else [i for i, p in enumerate(tree.parents)
                                                    if p < 0]
            match = next((c for c in nodes if tree.tokens[c] == nxt), None)
            if match is None:
                break
            path.append(match)
            row, nxt = match, int(logits[match + 1].argmax())
        for s in range(1, len(leaves) + 1):  # the tree's cells go; the pending ones stay
            ctx.lib.llama_memory_seq_rm(ctx.memory, s, -1, -1)
        pending = [tree.tokens[i] for i in path] + [nxt]
        out += pending
        session.observe(prompt + out, len(prompt) + len(out) - len(pending))
    session.finish(out[:NEW_TOKENS])
    return out[:NEW_TOKENS], passes


def step_ms(ctx: Context, context: int = 300, widths: tuple[int, ...] = (1, 2, 4, 8, 13)
            ) -> dict[str, float]:
    """What a step of each width costs after ``context`` tokens (medians of 15, ms): a
    one-token step on the one-token threads, wider ones on the batch threads."""
    ctx.prefill(list(range(1000, 1000 + context)))
    costs = {}
    for width in widths:
        times = []
        for _ in range(15):
            started = time.perf_counter()
            ctx.decode(list(range(2000, 2000 + width)), list(range(context, context + width)),
                       [[0]] * width, [True] * width)
            times.append(time.perf_counter() - started)
            ctx.lib.llama_memory_seq_rm(ctx.memory, 0, context, -1)
        costs[str(width)] = round(statistics.median(times) * 1000, 2)
    return costs


def main(budget: int = 12) -> dict[str, Any]:
    import llama_cpp as lib

    import rag_spec

    lib.llama_backend_init()
    params = lib.llama_model_default_params()
    params.use_extra_bufts = False
    model = lib.llama_model_load_from_file(str(_gguf()).encode(), params)
    lm = rag_spec.load_model()
    sets = held_out_prompts(lm, 8, 6)
    drafter = rag_spec.TrieDrafter()
    report: dict[str, Any] = {"benchmark": "llamacpp_trees", "command": command_line(),
                              "llama_cpp_python": lib.__version__, "machine": machine(),
                              "new_tokens": NEW_TOKENS, "budget": budget, "flash_attn": True}
    ctx = Context(lib, model, 2)
    report["step_ms_by_width"] = step_ms(ctx)
    ctx.close()
    print("step ms by width", report["step_ms_by_width"], flush=True)
    for name, prompts in sets.items():
        rows = []
        for i, prompt in enumerate(prompts):
            timed: dict[str, Any] = {}
            for system in (["plain", "trie"] if i % 2 == 0 else ["trie", "plain"]):
                ctx = Context(lib, model, budget + 2)
                started = time.perf_counter()
                if system == "plain":
                    tokens, passes = plain(ctx, prompt)
                else:
                    tokens, passes = speculative(ctx, prompt, drafter.session(prompt), budget)
                timed[system] = (time.perf_counter() - started, tokens, passes)
                ctx.close()
            rows.append({"prompt_tokens": len(prompt),
                         "identical": timed["trie"][1] == timed["plain"][1],
                         "speedup": round(timed["plain"][0] / timed["trie"][0], 3),
                         "plain_tok_per_s": round(NEW_TOKENS / timed["plain"][0], 1),
                         "trie_tok_per_s": round(NEW_TOKENS / timed["trie"][0], 1),
                         "tokens_per_pass": round((NEW_TOKENS - 1) / timed["trie"][2], 2)})
            print(name, rows[-1], flush=True)
        report[name] = {"prompts": rows,
                        "identical": sum(r["identical"] for r in rows),
                        "speedup": round(statistics.median(r["speedup"] for r in rows), 3),
                        "tokens_per_pass": round(statistics.mean(
                            r["tokens_per_pass"] for r in rows), 2)}
        print(name, {k: v for k, v in report[name].items() if k != "prompts"}, flush=True)
    lib.llama_model_free(model)
    write_result(report, f"llamacpp_trees_{budget}")
    return report


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 12)
