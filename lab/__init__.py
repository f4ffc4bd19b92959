"""The lab: benches that measure rag-spec itself rather than a user's model (a step against
the memory-bandwidth floor, the GPU check), kept outside the wheel. Run them from the
repository root: ``python -m lab.floor``, ``make gpu-check``. They write their JSON into
``lab/results/`` (``RESULTS``), never into docs/: what they found goes into docs/concepts.md as
sentences ("Why the defaults")."""

import json
from pathlib import Path

RESULTS = Path("lab/results")


def write_result(report: dict, name: str) -> Path:
    """``report`` as lab/results/NAME.json; says where it went."""
    out = RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return out


def held_out_prompts(lm: object, rag: int, open_ended: int) -> dict[str, list[list[int]]]:
    """Chat prompts of the first held-out RAG questions (each with its top-3 passages from the
    default knowledge base) and open-ended prompts, as ``lm``'s tokenizer writes them."""
    import rag_spec
    from rag_spec.bench.prompts import HELD_OUT_OPEN_PROMPTS, HELD_OUT_RAG_QUESTIONS

    tokenizer = lm.tokenizer  # type: ignore[attr-defined]
    questions = list(HELD_OUT_RAG_QUESTIONS[:rag])
    hits = rag_spec.KnowledgeBase.load_default().search(questions, k=3) if questions else []
    return {"rag": [rag_spec.chat_input_ids(tokenizer, rag_spec.rag_messages(q, h))
                    for q, h in zip(questions, hits)],
            "open_ended": [rag_spec.chat_input_ids(tokenizer, [{"role": "user", "content": p}])
                           for p in HELD_OUT_OPEN_PROMPTS[:open_ended]]}


def interleaved(runs: dict, sets: dict, baseline: str, references: dict[str, str],
                peers: tuple[str, ...] = ()) -> dict:
    """Each set's prompts through every system in ``runs`` (a callable per name: prompt ids ->
    token ids or a ``GenerationResult``), interleaved per prompt with the order rotating; per
    set: tok/s, the median per-prompt tok/s ratio over ``baseline`` (and over each of ``peers``
    in ``runs``), tokens per step where known, and for each system in ``references`` how many
    outputs equal its reference system's."""
    import statistics
    import time

    report = {}
    for set_name, prompts in sets.items():
        seconds: dict = {name: [] for name in runs}
        outputs: dict = {name: [] for name in runs}
        names = list(runs)
        for i, prompt in enumerate(prompts):
            for name in names[i % len(names):] + names[:i % len(names)]:
                started = time.perf_counter()
                outputs[name].append(runs[name](prompt))
                seconds[name].append(time.perf_counter() - started)
        tokens = {n: [o if isinstance(o, list) else o.token_ids for o in outs]
                  for n, outs in outputs.items()}
        rates = {n: [len(t) / s for t, s in zip(tokens[n], seconds[n])] for n in runs}
        row: dict = {}
        for name in runs:
            row[name] = {
                "tok_per_s": round(sum(map(len, tokens[name])) / sum(seconds[name]), 1)}
            for other in (baseline, *(p for p in peers if p in runs)):
                row[name][f"speedup_vs_{other}"] = round(statistics.median(
                    r / o for r, o in zip(rates[name], rates[other])), 3)
            if not isinstance(outputs[name][0], list):
                row[name]["tokens_per_step"] = round(statistics.mean(
                    o.stats.tokens_per_step for o in outputs[name]), 2)
        for name, reference in references.items():
            row[name][f"identical_to_{reference}"] = sum(
                a == b for a, b in zip(tokens[name], tokens[reference]))
        report[set_name] = {"prompts": len(prompts), "systems": row}
        print(set_name, row, flush=True)
    return report
