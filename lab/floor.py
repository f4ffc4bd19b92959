"""``python -m lab.floor``: how far a decoding step is from the memory-bandwidth floor.

A step for one row reads every weight once (an untied input embedding excepted: a step reads
only its rows). At this machine's read bandwidth that takes ``weight bytes / bandwidth``, the
floor no kernel beats. The report gives the bandwidth (the best of several full reads of a
buffer larger than the caches), the floor per dtype, and step costs beside it as multiples:
transformers' own one-token step (the peer), our runner's one-token step, and our step over a
root plus a 16-node tree, at a RAG prompt's length; and that tree step over the one-token step.
Every other speedup is tokens per step over such a step's cost.

A wide step has a second floor: its arithmetic. On a CPU of two cores a product over a tree's
rows is compute, not reads, so ``product_seconds`` times every linear layer's product alone, at
its best (weight in cache, the faster kernel), for one token and for a tree; with the one-token
products taken at no less than the weight read. The report's estimate of tree/plain is then
the one-token step with its products swapped for the tree's: what a tree step would cost beside
a one-token step if the products alone grew, each at its best speed. Its bound swaps them for
the tree's multiply-adds at this machine's peak (``matmul_peak``: a large square product on the
faster kernel, which no few-row kernel outruns), and no less than the weight read: no kernel
makes a tree step cheaper beside that one-token step. ``streamed_product_seconds`` runs the
model's own layers in order, their weights read from memory as in a step: where it exceeds both
the products in cache and the weight read, the kernel does not overlap reads with arithmetic.

``--compiled`` also times the step gpt-fast style (``compiled_step_seconds``): a static KV cache
sized for the answer, a dense mask over it, the whole forward pass through ``torch.compile``
(inductor's C++ on a CPU), interleaved with our eager runner's steps of the same widths. It
shows which widths compiling pays for; on a CPU ``LookaheadConfig(compile=True)`` compiles
one-token steps only, as measured here (on a GPU, as CUDA graphs, every width).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lab import RESULTS
from rag_spec.bench.report import figure, machine, median, publish, save_figure
from rag_spec_kernels.streamed import pack_streamed, streamed_available, streamed_linear

TREE_NODES = 16
# rows the streamed products are timed at: one token, the trees a CPU's sizer verifies (~4-12
# nodes and the root) and the 16-node tree
STREAMED_ROWS = (1, 5, 9, 13, 1 + TREE_NODES)


def read_bandwidth(gib: float = 1.0, repeats: int = 7) -> float:
    """Bytes per second of the best full read of a ``gib`` GiB buffer (a sum over it)."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    buffer.sum()  # pages touched before timing
    best = min(_seconds(buffer.sum) for _ in range(repeats))
    return buffer.numel() * 4 / best


def product_seconds(model: Any, rows: int, repeats: int = 30) -> float:
    """Seconds a step over ``rows`` tokens spends in its linear layers (the LM head included)
    if each ran as fast as the best of several isolated products of its shape, its weight in
    cache, on the fastest kernel this CPU offers."""
    shapes = Counter(tuple(m.weight.shape) for m in model.modules()
                     if isinstance(m, torch.nn.Linear))
    return sum(count * _best_product_seconds(torch.randn(rows, inner).to(model.dtype),
                                             torch.randn(outer, inner).to(model.dtype), repeats)
               for (outer, inner), count in shapes.items())


def streamed_product_seconds(model: Any, rows: int, repeats: int = 7) -> float:
    """Seconds of ``rows`` tokens through the model's own linear layers in order, their weights
    streamed from memory as in a step, each through a ``LinearStack`` of its own (the runner's
    kernel for a tree: the streamed one, else oneDNN's), stock products without oneDNN: where
    this exceeds both the products in cache and the weight read, reads and arithmetic do not
    overlap."""
    from rag_spec_kernels import LinearStack, onednn_available

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if onednn_available(model):
        products = [LinearStack([linear]).product for linear in linears]
    else:
        products = [lambda x, w=m.weight: torch.nn.functional.linear(x, w) for m in linears]
    inputs = [torch.randn(rows, m.in_features).to(model.dtype) for m in linears]

    def all_layers() -> None:
        for product, x in zip(products, inputs):
            product(x)

    all_layers()  # kernels chosen before timing
    return median([_seconds(all_layers) for _ in range(repeats)])


def matmul_peak(dtype: torch.dtype, size: int = 2048, repeats: int = 5) -> float:
    """Floating-point operations per second of the best ``size``-square product in ``dtype``
    (on any kernel ``_best_product_seconds`` tries): the arithmetic speed a product over many
    rows reaches here. On AMD CPUs the stock fp32 kernel (MKL) reaches under half of oneDNN's."""
    square = torch.randn(size, size).to(dtype)
    return 2 * size**3 / _best_product_seconds(square, square.clone(), repeats)


def _best_product_seconds(x: torch.Tensor, weight: torch.Tensor, repeats: int) -> float:
    """The best of ``repeats`` timings of ``x @ weight.T`` on each kernel this CPU offers
    (stock, oneDNN's, the streamed one)."""
    from rag_spec_kernels import onednn_packs, pack_weight, packed_linear

    products = [lambda: torch.nn.functional.linear(x, weight)]
    if onednn_packs(weight.dtype):
        packed = pack_weight(weight)
        products.append(lambda: packed_linear(x, packed))
    if streamed_available(weight.dtype):
        blocks = pack_streamed(weight)
        products.append(lambda: streamed_linear(x, blocks, weight.shape[0]))
    best = float("inf")
    for product in products:
        product()  # kernels chosen before timing
        best = min(best, *(_seconds(product) for _ in range(repeats)))
    return best


def linear_flops(model: Any, rows: int) -> int:
    """Floating-point operations of ``rows`` tokens through every linear layer (LM head too)."""
    return 2 * rows * sum(m.weight.numel() for m in model.modules()
                          if isinstance(m, torch.nn.Linear))


def weight_bytes(model: Any) -> int:
    """Bytes of weights a one-token step reads."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is not None and head.weight.data_ptr() == embedding.data_ptr():
        return total  # the LM head reads the whole matrix
    return total - embedding.numel() * embedding.element_size()


@torch.inference_mode()
def step_seconds(model: Any, prompt: Sequence[int], widths: Sequence[int] = (1, 1 + TREE_NODES),
                 repeats: int = 9) -> dict[str, float]:
    """Median seconds of transformers' one-token step (``hf_1``) and of our runner's steps
    ``widths`` tokens wide (``rag_spec_W``; with exact numerics ``rag_spec_exact_W``; where the
    streamed kernel runs, on oneDNN's instead ``rag_spec_onednn_W``), after ``prompt``'s
    prefill."""
    from transformers import DynamicCache

    from rag_spec.target.transformers.kv_cache import cache_argument
    from rag_spec.target.transformers.runner import RunnerSettings

    ids = torch.tensor([list(prompt)], device=model.device)
    past = cache_argument(model, DynamicCache(config=model.config))  # transformers' own
    model(input_ids=ids, use_cache=True, **past)
    token = ids[:, -1:]

    def hf_step() -> None:
        model(input_ids=token, use_cache=True, **past)  # appends a position

    costs = {"hf_1": median([_seconds(hf_step, model.device) for _ in range(repeats)])}
    systems = {"rag_spec": RunnerSettings(), "rag_spec_exact": RunnerSettings(exact=True)}
    if streamed_available(model.dtype):
        systems["rag_spec_onednn"] = RunnerSettings(streamed_linear=False)
    for name, settings in systems.items():
        for width, seconds in runner_step_seconds(model, prompt, widths, repeats,
                                                  settings).items():
            costs[f"{name}_{width}"] = seconds
    return costs


@torch.inference_mode()
def runner_step_seconds(model: Any, prompt: Sequence[int], widths: Sequence[int],
                        repeats: int = 9, settings: Any = None) -> dict[int, float]:
    """Median seconds of our runner's forward pass (``settings``: default kernels) over a root
    plus a chain of ``width - 1`` draft tokens after ``prompt``'s prefill, per width (the first
    pass of a width, which prepares its kernels, is not timed)."""
    from rag_spec.target.transformers.prefill import prefill
    from rag_spec.target.transformers.runner import Runner
    from rag_spec.target.transformers.step_inputs import tree_step
    from rag_spec.target.tree import TokenTree

    runner = Runner.of(model, settings)
    costs = {}
    for width in widths:
        cache = prefill(runner, [list(prompt)])
        tree = TokenTree(tuple(range(3, 2 + width)), tuple(range(-1, width - 2)))
        timings = []
        for _ in range(repeats + 1):
            batch = tree_step(cache, [tree], runner.dtype)
            timings.append(_seconds(lambda c=cache, b=batch: runner.forward(c, b),
                                    model.device))
            cache.keep([[]], [3])  # the root stays: one position per step, as in hf_step
        costs[width] = median(timings[1:])
    return costs


@dataclass(frozen=True)
class CompiledSteps:
    """``compiled_step_seconds``' findings, per width."""

    seconds: dict[int, float]  # median of a pass
    first_pass_seconds: dict[int, float]  # tracing and compiling, or loading inductor's cache
    logit_error: dict[int, float]  # largest |compiled - the model's own eager logits|
    same_argmax: dict[int, bool]  # every position's top token the same as eager's


@torch.inference_mode()
def compiled_step_seconds(model: Any, prompt: Sequence[int], widths: Sequence[int],
                          repeats: int = 9, answer_tokens: int = 128) -> CompiledSteps:
    """Time a compiled forward pass over a root plus a chain of ``width - 1`` tokens after
    ``prompt`` (the prompt's last ``width`` tokens again), per width, and check its logits
    against the model's own eager pass over the same tokens. The pass is the decoder's compiled
    step (``Runner.compiled``: a private module tree on the stock linear kernels) with a static
    cache of ``prompt + answer_tokens + width`` slots and a dense additive mask over them;
    shapes are dynamic, so one compilation serves every width above one (a single token
    compiles its own)."""
    from rag_spec.target.transformers.compiled_step import rewind, static_cache
    from rag_spec.target.transformers.kv_cache import cache_argument
    from rag_spec.target.transformers.runner import Runner, RunnerSettings
    from rag_spec_kernels import stack_table

    step = Runner.of(model, RunnerSettings(compile=True)).compiled
    assert step is not None
    device, length = model.device, len(prompt)
    capacity = length + answer_tokens + max(widths)
    cache = static_cache(step.module.config, capacity)
    with stack_table(step.stacks):  # the eager tree's traced layers name their stacks
        step.module(input_ids=torch.tensor([list(prompt)], device=device), use_cache=True,
                    **cache_argument(step.module, cache))

    def compiled(ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor
                 ) -> torch.Tensor:
        rewind(cache, length)  # each pass rewrites the same slots
        return step(input_ids=ids, position_ids=positions, attention_mask=mask, cache=cache)

    found = CompiledSteps({}, {}, {}, {})
    for width in widths:
        chain = list(prompt)[-width:]
        ids = torch.tensor([chain], device=device)
        positions = torch.arange(length, length + width, device=device)[None]
        allowed = torch.zeros(1, 1, width, capacity, dtype=torch.bool, device=device)
        allowed[..., :length] = True
        allowed[0, 0, :, length:length + width] = torch.ones(width, width).tril().bool()
        mask = torch.zeros(allowed.shape, dtype=model.dtype, device=device)
        mask.masked_fill_(~allowed, torch.finfo(model.dtype).min)
        timings = [_seconds(lambda i=ids, p=positions, m=mask: compiled(i, p, m), device)
                   for _ in range(repeats + 1)]
        logits = compiled(ids, positions, mask).float()
        eager = model(input_ids=torch.tensor([list(prompt) + chain], device=device)
                      ).logits[:, -width:].float()
        found.first_pass_seconds[width], found.seconds[width] = timings[0], median(timings[1:])
        found.logit_error[width] = (logits - eager).abs().max().item()
        found.same_argmax[width] = bool((logits.argmax(-1) == eager.argmax(-1)).all())
    return found


def compiled_over_eager(model: Any, prompt: Sequence[int], widths: Sequence[int],
                        rounds: int = 3) -> dict[str, Any]:
    """The compiled step against our eager runner's, interleaved over ``rounds``: per width the
    median of the rounds' ratios, both systems' median milliseconds, the first round's first-pass
    seconds (compilation; later rounds reuse it) and its logits' agreement with eager ones."""
    ratios: dict[int, list[float]] = {w: [] for w in widths}
    eager: dict[int, list[float]] = {w: [] for w in widths}
    compiled: dict[int, list[float]] = {w: [] for w in widths}
    first: CompiledSteps | None = None
    for _ in range(rounds):
        ours = runner_step_seconds(model, prompt, widths)
        theirs = compiled_step_seconds(model, prompt, widths)
        first = first or theirs
        for width in widths:
            eager[width].append(ours[width])
            compiled[width].append(theirs.seconds[width])
            ratios[width].append(theirs.seconds[width] / ours[width])
    assert first is not None
    return {"compiled_ms": {w: round(1e3 * median(t), 2) for w, t in compiled.items()},
            "eager_ms": {w: round(1e3 * median(t), 2) for w, t in eager.items()},
            "compiled_over_eager": {w: round(median(r), 2) for w, r in ratios.items()},
            "first_pass_s": {w: round(s, 1) for w, s in first.first_pass_seconds.items()},
            "max_logit_error": first.logit_error, "same_argmax": first.same_argmax}


def run(dtypes: Sequence[str] = ("float32", "bfloat16"), json_out: str | None = None,
        model_name: str = "smollm2-135m-instruct", compiled: bool = False) -> dict[str, Any]:
    """Measure, print a table, write JSON and a PNG plot; return the report."""
    from rag_spec.bench.lookahead import prompt_sets
    from rag_spec.bench.prompts import RAG_QUESTIONS
    from rag_spec.models import load_model

    bandwidth = read_bandwidth()
    report: dict[str, Any] = {"benchmark": "floor", "model": model_name,
                              "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                              "tree_nodes": TREE_NODES, "machine": machine(), "dtypes": {}}
    for dtype in dtypes:
        lm = load_model(model_name, dtype=dtype)
        prompt = prompt_sets(lm.tokenizer, RAG_QUESTIONS[:1], 1)[0][0]
        weights = weight_bytes(lm.model)
        floor = weights / bandwidth
        products = {rows: max(floor, product_seconds(lm.model, rows))
                    for rows in (1, 1 + TREE_NODES)}
        streamed = {rows: streamed_product_seconds(lm.model, rows) for rows in STREAMED_ROWS}
        arithmetic = linear_flops(lm.model, 1 + TREE_NODES) / matmul_peak(lm.model.dtype)
        steps = step_seconds(lm.model, prompt)
        plain = steps["rag_spec_1"]
        estimate = plain - products[1] + products[1 + TREE_NODES]
        tree_over_plain = {name: round(steps[f"{name}_{1 + TREE_NODES}"] / steps[f"{name}_1"], 2)
                           for name in ("rag_spec", "rag_spec_exact", "rag_spec_onednn")
                           if f"{name}_1" in steps}
        report["prompt_tokens"] = len(prompt)
        report["dtypes"][dtype] = {
            "weight_mb": round(weights / 2**20, 1), "floor_ms": round(1e3 * floor, 2),
            "step_ms": {name: round(1e3 * s, 2) for name, s in steps.items()},
            "over_floor": {name: round(s / floor, 2) for name, s in steps.items()},
            "tree_over_plain": tree_over_plain["rag_spec"],
            "products_ms": {rows: round(1e3 * t, 2) for rows, t in products.items()},
            "tree_over_plain_estimate": round(estimate / plain, 2),
            "streamed_products_ms": {rows: round(1e3 * t, 2) for rows, t in streamed.items()},
            "tree_products_at_peak_ms": round(1e3 * arithmetic, 2),
            "tree_over_plain_bound": _bound(plain, products[1], arithmetic, floor),
            "exact_tree_over_plain": tree_over_plain["rag_spec_exact"],
            "onednn_tree_over_plain": tree_over_plain.get("rag_spec_onednn")}
        if compiled:
            row = report["dtypes"][dtype]
            row["compiled"] = compiled_over_eager(lm.model, prompt, (1, 5, 1 + TREE_NODES))
            for width in (1, 1 + TREE_NODES):  # beside the others in the plot
                ms = row["compiled"]["compiled_ms"][width]
                row["step_ms"][f"compiled_{width}"] = ms
                row["over_floor"][f"compiled_{width}"] = round(ms / row["floor_ms"], 2)
            row["compiled"]["tree_over_plain_bound"] = _bound(
                row["compiled"]["compiled_ms"][1] / 1e3, products[1], arithmetic, floor)
    publish(report, json_out, "floor", _plot, _print_table, RESULTS)
    return report


def _bound(plain: float, one_row_products: float, tree_products: float, floor: float
           ) -> float:
    """The least a tree step can cost over a ``plain`` one-token step: its products swapped for
    the tree's at the arithmetic peak (no less than the weight read)."""
    return round((plain - one_row_products + max(tree_products, floor)) / plain, 2)


def _seconds(call: Callable[[], Any], device: torch.device | None = None) -> float:
    from rag_spec.policy.step_costs import settle

    if device is not None:
        settle(device)  # earlier queued work is not this call's
    started = time.perf_counter()
    call()
    if device is not None:
        settle(device)
    return time.perf_counter() - started


def _plot(report: dict[str, Any], path: Path) -> None:
    fig, ax = figure(size=(8, 4))
    names = list(dict.fromkeys(n for row in report["dtypes"].values() for n in row["over_floor"]))
    width = 0.8 / len(report["dtypes"])
    for i, (dtype, row) in enumerate(report["dtypes"].items()):
        ax.bar([j + i * width for j in range(len(names))],
               [row["over_floor"].get(n, 0) for n in names], width,
               label=f"{dtype} (floor {row['floor_ms']} ms)")
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks([j + width * (len(report["dtypes"]) - 1) / 2 for j in range(len(names))],
                  names, rotation=20, ha="right")
    ax.set_ylabel("step cost / weight-read floor")
    ax.legend()
    save_figure(fig, path, f"{report['model']}, {report['read_bandwidth_gb_s']} GB/s read, "
                           f"{report['machine']['cpus']} CPUs")


def _print_table(report: dict[str, Any]) -> None:
    print(f"read bandwidth {report['read_bandwidth_gb_s']} GB/s, prompt "
          f"{report['prompt_tokens']} tokens")
    for dtype, row in report["dtypes"].items():
        steps = ", ".join(f"{name} {ms} ms ({row['over_floor'][name]}x)"
                          for name, ms in row["step_ms"].items())
        print(f"{dtype}: weights {row['weight_mb']} MB, floor {row['floor_ms']} ms; {steps}; "
              f"tree/plain {row['tree_over_plain']}x (exact {row['exact_tree_over_plain']}x"
              + (f", on oneDNN {row['onednn_tree_over_plain']}x"
                 if row["onednn_tree_over_plain"] else "") + "); "
              f"linear products at their best: {row['products_ms']} ms for 1 / "
              f"{1 + TREE_NODES} tokens, so tree/plain ~{row['tree_over_plain_estimate']}x; "
              f"streamed from memory {row['streamed_products_ms']} ms; "
              f"at the arithmetic peak {row['tree_products_at_peak_ms']} ms, so tree/plain >= "
              f"{row['tree_over_plain_bound']}x")
        if "compiled" in row:
            c = row["compiled"]
            print(f"{dtype} compiled (static cache, torch.compile) / our eager step, per width: "
                  f"{c['compiled_over_eager']} ({c['compiled_ms']} ms against {c['eager_ms']} "
                  f"ms; first passes {c['first_pass_s']} s); compiled tree/plain >= "
                  f"{c['tree_over_plain_bound']}x")


def _dtypes(text: str) -> tuple[str, ...]:
    import argparse

    dtypes = tuple(part.strip() for part in text.split(","))
    bad = [d for d in dtypes if d not in ("float32", "bfloat16", "float16")]
    if bad or not dtypes:
        msg = f"expected float32, bfloat16 or float16, comma-separated; got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return dtypes


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m lab.floor``: the bench, with the options ``run`` takes."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m lab.floor", description=__doc__)
    parser.add_argument("--dtype", type=_dtypes, default=("float32", "bfloat16"),
                        help="comma-separated (default float32,bfloat16)")
    parser.add_argument("--json", dest="json_out", help="write the report here")
    parser.add_argument("--compiled", action="store_true",
                        help="also time a torch.compile'd step on a static cache against ours "
                             "(compiles for minutes on a CPU)")
    args = parser.parse_args(argv)
    run(dtypes=args.dtype, json_out=args.json_out, compiled=args.compiled)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
