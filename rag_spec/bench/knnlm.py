"""``rag-spec bench knnlm``: naive vs speculative kNN-LM (RaLMSpec's second workload).

The datastore is the embedded model's hidden states over the default corpus, padded with
labelled random distractors to ``kb_size`` entries (as the RaLM bench pads its index), searched
exactly (flat, matrix products) or approximately (IVF-PQ). Prompts open passages of the corpus,
so the datastore holds text the generation can follow.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from rag_spec.bench.report import (
    Run,
    interleaved,
    loop_summary,
    machine,
    median,
    print_loop_table,
    publish,
    rss_mb,
    speedup_bars,
    stamped,
)

PROMPT_WORDS = 8  # of a passage's text after its title


def systems() -> dict[str, Any]:
    """name -> KNNSpeculation (None: the naive loop, a search per token)."""
    from rag_spec.knnlm import KNNSpeculation

    return {"naive": None,
            "spec_no_successors": KNNSpeculation(os3=False, stride=4, successors=0),
            "spec": KNNSpeculation(os3=False, stride=4),
            "spec_all": KNNSpeculation()}


def run(retriever: str = "exact", kb_size: int = 1_000_000, k: int = 16, limit: int = 6,
        max_new_tokens: int = 32, precision: str = "float32", nprobe: int = 32,
        json_out: str | None = None) -> dict[str, Any]:
    """Run the benchmark; print a table; write JSON and a PNG; return the report."""
    from rag_spec.corpus import DEFAULT_SOURCES, load_passages
    from rag_spec.knnlm import KNNLM, KNNDatastore
    from rag_spec.knnlm.datastore import passage_text
    from rag_spec.models import load_model

    lm = load_model()
    started = time.perf_counter()
    datastore = KNNDatastore.open(lm, precision=precision)
    real = len(datastore)
    if kb_size > real:
        datastore = datastore.with_distractors(kb_size)
    if retriever == "approx":
        datastore = datastore.as_kind("ivfpq", nprobe=nprobe)
    print(f"datastore: {len(datastore)} entries ({real} from text), {retriever}, "
          f"{datastore.nbytes / 1e9:.2f} GB, ready in {time.perf_counter() - started:.0f} s")
    passages = load_passages(DEFAULT_SOURCES)
    picks = np.linspace(0, len(passages) - 1, limit).astype(int)
    prompts = [" ".join(passage_text(passages[i].title, passages[i].text).split(" ")
                        [:PROMPT_WORDS]) for i in picks]

    def system(speculation: Any) -> Any:
        knn = KNNLM(lm, datastore, k=k, speculation=speculation)  # one per system: OS3 learns

        def one(prompt: str) -> Run:
            result = knn.generate(prompt, max_new_tokens)
            return Run(0.0, result.token_ids, {"stats": result.stats})
        return one

    runs = interleaved({name: system(s) for name, s in systems().items()}, prompts)
    naive = runs["naive"]
    share = median([r.extra["stats"].retrieval_seconds / r.seconds for r in naive])
    report: dict[str, Any] = {
        "benchmark": "knnlm", "retriever": retriever, "prompts": len(prompts),
        "datastore_size": len(datastore), "real_entries": real, "precision": precision,
        "nprobe": nprobe if retriever == "approx" else None, "k": k,
        "lambda": 0.25, "max_new_tokens": max_new_tokens,
        "retrieval_share": round(share, 3), "amdahl_bound": round(1 / max(1 - share, 1e-9), 3),
        "datastore_gb": round(datastore.nbytes / 1e9, 2), "rss_mb": round(rss_mb(), 1),
        "machine": machine(), "systems": {}}
    for name, system_runs in runs.items():
        report["systems"][name] = {
            "seconds_per_prompt": round(median([r.seconds for r in system_runs]), 3),
            **loop_summary(naive, system_runs),
            "tokens": round(float(np.mean([len(r.tokens) for r in system_runs])), 1),
            "guess_seconds": round(median([r.extra["stats"].guess_seconds
                                           for r in system_runs]), 3),
            "per_prompt_speedup": [round(n.seconds / r.seconds, 3)
                                   for n, r in zip(naive, system_runs)]}
    name = f"knnlm_{retriever}_{len(datastore)}_k{k}"
    publish(report, json_out, name, _plot, _print_table)
    return report


def compare_keys(eval_source: str = "pkg:tqdm", limit: int = 150, k: int = 16,
                 lambda_: float = 0.25, temperatures: tuple[float, ...] = (1.0, 3.0, 10.0, 30.0),
                 json_out: str | None = None) -> dict[str, Any]:
    """Which key predicts better: perplexity of the model alone and of the kNN-LM, and the kNN
    distribution's top-1 accuracy, on text the datastore (the default corpus) does not hold."""
    import torch

    from rag_spec.corpus import load_passages
    from rag_spec.knnlm import KNNLM, KNNDatastore
    from rag_spec.knnlm.datastore import passage_text
    from rag_spec.knnlm.keys import KEY_KINDS
    from rag_spec.models import load_model

    lm = load_model()
    texts = [passage_text(p.title, p.text) for p in load_passages([eval_source])][:limit]
    report: dict[str, Any] = stamped({
        "eval_source": eval_source, "eval_texts": len(texts), "k": k, "lambda": lambda_,
        "machine": machine(), "keys": {}}, "knnlm_keys")
    for key in KEY_KINDS:
        store = KNNDatastore.open(lm, key=key)
        scores: dict[str, list[float]] = {"lm": [], "knn_top1": []}
        scores.update({f"knnlm_t{t:g}": [] for t in temperatures})
        knns = {t: KNNLM(lm, store, k=k, lambda_=lambda_, temperature=t) for t in temperatures}
        for text in texts:
            ids = lm.tokenizer(text)["input_ids"][:512]
            logits, keys = knns[temperatures[0]].keyed(torch.tensor([ids]))
            distances, neighbours = store.search(keys[0, :-1].numpy(), k)
            for t, target in enumerate(ids[1:]):
                scores["lm"].append(-float(torch.log_softmax(logits[0, t].double(), -1)[target]))
                scores["knn_top1"].append(float(store.values[neighbours[t, 0]] == target))
                for temperature, knn in knns.items():
                    p = knn.distribution(logits[0, t], distances[t], neighbours[t])
                    scores[f"knnlm_t{temperature:g}"].append(-float(torch.log(p[target])))
        report["keys"][key] = {
            "tokens": len(scores["lm"]),
            "knn_top1_accuracy": round(float(np.mean(scores["knn_top1"])), 4),
            "perplexity": {name: round(float(np.exp(np.mean(values))), 3)
                           for name, values in scores.items() if name != "knn_top1"}}
        print(key, report["keys"][key])
    out = Path(json_out) if json_out else Path("docs/benchmarks/knnlm_keys.json")
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")
    return report


def _plot(report: dict[str, Any], path: Path) -> None:
    speedup_bars(report, path, "kNN-LM",
                 f"kNN-LM, {report['retriever']}, {report['datastore_size']:,} entries, "
                 f"k={report['k']}, retrieval share {report['retrieval_share']:.2f}")


def _print_table(report: dict[str, Any]) -> None:
    print_loop_table(report, f"kNN-LM {report['retriever']}, {report['datastore_size']} entries, "
                     f"k {report['k']}, rss {report['rss_mb']:.0f} MB",
                     "seconds_per_prompt", "prompts")
