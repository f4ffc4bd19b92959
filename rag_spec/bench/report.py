"""Shared benchmark plumbing: interleaved timing, summaries, the machine, JSON and PNG output."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DRAFT_MODES = ("greedy", "sampling", "batch")  # the runs of ``bench draft``

REPORT_DIR = Path("docs/benchmarks")


@dataclass
class Run:
    """One system on one prompt."""

    seconds: float
    tokens: list[int]
    extra: dict[str, Any] = field(default_factory=dict)


def interleaved(systems: dict[str, Callable[[Any], Run]], items: Sequence[Any],
                progress: Callable[[str], None] = print) -> dict[str, list[Run]]:
    """Run every system on every item, rotating the order per item (A B C, B C A, ...)."""
    names = list(systems)
    runs: dict[str, list[Run]] = {name: [] for name in names}
    for i, item in enumerate(items):
        order = names[i % len(names):] + names[:i % len(names)]
        for name in order:
            started = time.perf_counter()
            run = systems[name](item)
            run.seconds = time.perf_counter() - started
            runs[name].append(run)
        progress(f"  [{i + 1}/{len(items)}] " + "  ".join(
            f"{n} {len(runs[n][-1].tokens) / runs[n][-1].seconds:5.1f} tok/s" for n in names))
    return runs


# tree steps' costs by width on a GPU, as ``make gpu-check`` measured them (an 8B-shaped model)
GPU_STEPS = REPORT_DIR / "gpu_check_h100_32_layers.json"


def gpu_projection(tokens_per_step: float, width: int, report: Path = GPU_STEPS
                   ) -> dict[str, Any] | None:
    """What a GPU user keeps of a CPU run's tokens per forward pass: its speedup over our own
    no-draft decoder there is the tokens per pass over what a step ``width`` tokens wide costs
    against a one-token step (``step_ms`` of ``make gpu-check``'s report, at the nearest
    measured width at or above ``width``; never below a plain step). None without a report
    (``rag-spec bench`` run outside the repository)."""
    if not report.is_file():
        return None
    steps = json.loads(report.read_text())["step_ms"]
    plain = steps["rag_spec_1"]
    widths = sorted(int(k.rsplit("_", 1)[1]) for k in steps
                    if k.startswith("rag_spec_") and k.rsplit("_", 1)[1].isdigit())
    wide = next((w for w in widths if w >= width), widths[-1])
    cost = max(steps[f"rag_spec_{wide}"], plain) / plain
    return {"speedup_vs_no_drafts": round(tokens_per_step / cost, 2),
            "step_cost": round(cost, 3), "width": wide, "device": report.stem}


# ``LookaheadConfig`` fields of a decoder on the model's own (de-quantised) weights, never a
# GGUF file's blocks: the benches that compare with transformers' ``generate`` (or pipelines on
# it), or ablate its kernels, decode the weights it decodes
DEQUANTIZED: dict[str, Any] = {"quantized": False}


def dequantized(**knobs: Any) -> Any:
    """A ``LookaheadConfig`` with ``knobs`` on the model's own weights (``DEQUANTIZED``)."""
    from rag_spec.engine.decoder import LookaheadConfig

    return LookaheadConfig(**DEQUANTIZED, **knobs)


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


def pass_statistics(stats: Sequence[Any]) -> dict[str, float]:
    """Tokens per forward pass of generations (their ``DecodeStats``), the three ways every
    bench states them: ``tokens_per_step``, the mean over generations (the headline's and the
    issue goals' statistic); ``tokens_per_step_median``; ``tokens_per_step_pooled``, every
    token over every pass (a long answer weighs more). One helper, so that no two reports
    disagree only in how they averaged. Empty without generations (the ``hf`` peers)."""
    if not stats:
        return {}
    per = [s.tokens_per_step for s in stats]
    tokens = sum(s.tokens_per_step * s.steps for s in stats)
    return {"tokens_per_step": round(statistics.mean(per), 3),
            "tokens_per_step_median": round(median(per), 3),
            "tokens_per_step_pooled": round(tokens / max(sum(s.steps for s in stats), 1), 3)}


def runs_pass_statistics(runs: Sequence[Run]) -> dict[str, float]:
    """``pass_statistics`` of every generation in ``runs`` (each run's ``extra["stats"]``, a
    list: a batch's rows; none for a peer)."""
    return pass_statistics([s for r in runs for s in r.extra.get("stats", [])])


def rss_mb() -> float:
    """Resident memory of this process now, in MB (Linux; NaN elsewhere)."""
    return _status_mb("VmRSS:")


def peak_rss_mb() -> float:
    """Peak resident memory of this process since the last ``reset_peak_rss``, in MB."""
    return _status_mb("VmHWM:")


def reset_peak_rss() -> None:
    """Start a new peak (Linux: writing 5 to clear_refs resets the high-water mark)."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def _status_mb(field: str) -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def machine() -> dict[str, Any]:
    import torch
    import transformers

    from rag_spec_kernels import cpu_info, vector_flags

    cpu = cpu_info()
    return {"platform": platform.platform(), "processor": platform.processor(),
            # which VM class ran it (its CPU model and vector instructions): the figures move
            # with it
            "cpu": cpu.get("model name", ""), "cpu_family": cpu.get("cpu family", ""),
            "cpu_model": cpu.get("model", ""), "vector_flags": vector_flags(),
            "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}


def command_line() -> str:
    """How this process was started, as a user would type it (``rag-spec bench ...``,
    ``python -m lab...``): the benchmarks page shows it beside the figures."""
    if Path(sys.argv[0]).name == "rag-spec":
        return shlex.join(["rag-spec", *sys.argv[1:]])
    return shlex.join(["python", *sys.orig_argv[1:]])


def code_version() -> str:
    """The code a bench ran: the checkout's commit (``+changes`` where files differ from it),
    or the installed version outside a checkout."""
    import subprocess

    import rag_spec

    here = Path(rag_spec.__file__).parent
    try:
        commit = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=10", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
        changed = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "-uno"],
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return f"rag-spec {rag_spec.__version__}"
    return f"{commit}{'+changes' if changed else ''}"


def stamped(report: dict[str, Any], name: str) -> dict[str, Any]:
    """``report`` with its bench's name, the command that ran it, today's date and the code
    it ran first."""
    return {"benchmark": name, "command": command_line(),
            "date": datetime.date.today().isoformat(), "commit": code_version(), **report}


def publish(report: dict[str, Any], json_out: str | None, name: str,
            plot: Callable[[dict[str, Any], Path], None],
            table: Callable[[dict[str, Any]], None], directory: Path = REPORT_DIR) -> None:
    """Write the JSON (``json_out``, else ``directory``/NAME.json; the command and the date
    first) and the PNG beside it, then print the table and where both went.
    ``python -m rag_spec.bench.page`` renders the benchmarks page from docs/benchmarks/."""
    out = Path(json_out) if json_out else directory / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    report = stamped(report, name)
    out.write_text(json.dumps(report, indent=2) + "\n")
    plot(report, out.with_suffix(".png"))
    table(report)
    print(f"wrote {out} and {out.with_suffix('.png')}")


def figure(ncols: int = 1, size: tuple[float, float] = (8, 4), **kwargs: Any) -> tuple[Any, Any]:
    """A matplotlib figure drawn off-screen (benchmarks run headless)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size, **kwargs)


def save_figure(fig: Any, path: Path, title: str | None = None) -> None:
    """Title (the setting: model, dtype, cores, ...), lay out, write the PNG, free the figure."""
    import matplotlib.pyplot as plt

    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def setting(report: dict[str, Any]) -> str:
    """The model, dtype and cores a report was measured with, for a plot's title."""
    return f"{report['model']}, {report['dtype']}, {report['machine']['cpus']} CPUs"


def loop_summary(naive: Sequence[Run], runs: Sequence[Run]) -> dict[str, Any]:
    """What a retrieval loop's runs are reported with, against the naive loop's on the same
    items (``extra["stats"]``: kb_calls, retrieval/generation seconds, rollbacks, strides)."""
    import numpy as np

    stats = [r.extra["stats"] for r in runs]
    return {
        "speedup_vs_naive": round(median([n.seconds / r.seconds for n, r in zip(naive, runs)]),
                                  3),
        "identical_to_naive": sum(r.tokens == n.tokens for n, r in zip(naive, runs)),
        "kb_calls": round(float(np.mean([s.kb_calls for s in stats])), 2),
        "retrieval_seconds": round(median([s.retrieval_seconds for s in stats]), 3),
        "generation_seconds": round(median([s.generation_seconds for s in stats]), 3),
        "rollbacks": round(float(np.mean([s.rollbacks for s in stats])), 2),
        "mean_stride": round(float(np.mean([np.mean(s.strides) if s.strides else 1
                                            for s in stats])), 2)}


def speedup_bars(report: dict[str, Any], path: Path, loop: str, title: str) -> None:
    """Each system's median speedup over the naive ``loop``, beside the Amdahl bound."""
    names = list(report["systems"])
    fig, ax = figure()
    ax.bar(names, [report["systems"][n]["speedup_vs_naive"] for n in names], color="#4c72b0")
    ax.axhline(report["amdahl_bound"], color="red", ls="--", lw=1,
               label=f"Amdahl bound {report['amdahl_bound']:.2f}x")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_ylabel(f"speedup vs naive {loop} (median)")
    ax.set_title(title)
    ax.legend()
    save_figure(fig, path)


def print_loop_table(report: dict[str, Any], setting: str, seconds: str, items: str) -> None:
    """The ``setting`` and its Amdahl bound, then a line per system: seconds (the ``seconds``
    key), speedup, outputs identical out of ``report[items]``, calls and stride."""
    print(f"\n{setting}, retrieval share {report['retrieval_share']:.2f} "
          f"(Amdahl bound {report['amdahl_bound']:.2f}x)")
    for name, s in report["systems"].items():
        print(f"{name:20} {s[seconds]:7.2f} s  {s['speedup_vs_naive']:5.2f}x  identical "
              f"{s['identical_to_naive']}/{report[items]}  kb calls {s['kb_calls']}  "
              f"stride {s['mean_stride']}")


def padded_generate(model: Any, prompts: Sequence[list[int]], pad_token_id: int,
                    streamer: Any = None, **options: Any) -> list[list[int]]:
    """transformers ``generate`` on a left-padded batch; each row's new tokens, up to its end
    of sequence (generate pads after it)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_token_id)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):  # left padding, as generate expects
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    out = model.generate(ids.to(model.device), attention_mask=mask.to(model.device),
                         pad_token_id=pad_token_id, streamer=streamer, **options)
    eos = model.generation_config.eos_token_id
    rows = []
    for row in out[:, width:].tolist():
        for e in eos if isinstance(eos, list) else [eos]:
            if e is not None and e in row:
                row = row[:row.index(e) + 1]
        rows.append(row)
    return rows


def rows_run(rows: list[list[int]], extra: dict[str, Any] | None = None) -> Run:
    """A run's tokens, all rows end to end (what tok/s counts), and each row's own."""
    return Run(0.0, [t for row in rows for t in row], {"rows": rows, **(extra or {})})


def rows_summary(runs: dict[str, list[Run]], check: bool) -> dict[str, Any]:
    """Each system's ``rows_run`` runs against transformers' (``hf``), and against assisted
    generation's (``hf_assisted``) where it ran: medians of per-item ratios, tokens per pass
    over every row's ``DecodeStats`` (``extra["stats"]``), and with ``check`` how many items
    gave every row generate's tokens."""
    baseline = runs["hf"]
    systems: dict[str, Any] = {}
    for name, system_runs in runs.items():
        tokens = [len(r.tokens) for r in system_runs]
        speedups = [b.seconds / r.seconds * n / max(len(b.tokens), 1)
                    for b, r, n in zip(baseline, system_runs, tokens)]
        entry: dict[str, Any] = {
            "tok_per_s": round(median([n / r.seconds for n, r in zip(tokens, system_runs)]), 2),
            "speedup_vs_hf": round(median(speedups), 3),
            "per_prompt_speedup": [round(s, 3) for s in speedups]}
        if check:
            entry["identical_to_hf"] = sum(r.extra["rows"] == b.extra["rows"]
                                           for b, r in zip(baseline, system_runs))
        entry.update(runs_pass_statistics(system_runs))
        for key in ("seconds_per_step", "accepted_share", "prefill_seconds"):
            values = [r.extra[key] for r in system_runs if key in r.extra]
            if values:
                entry[key] = round(median(values), 4)
        systems[name] = entry
    for name, entry in systems.items():  # against each peer a user would pick instead
        if name.startswith("rag_spec") and "hf_assisted" in systems:
            entry["speedup_vs_hf_assisted"] = round(median([
                a.seconds / r.seconds * len(r.tokens) / max(len(a.tokens), 1)
                for a, r in zip(runs["hf_assisted"], runs[name])]), 3)
    return {"prompts": len(baseline), "systems": systems}
