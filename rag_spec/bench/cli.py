"""``rag-spec bench ...`` subcommands."""

from __future__ import annotations

import argparse
from importlib.metadata import entry_points
from typing import Any

from rag_spec.bench.report import DRAFT_MODES
from rag_spec.errors import RagSpecError


def add_bench_commands(commands: Any) -> None:
    from rag_spec.models.registry import DEFAULT_MODEL

    bench = commands.add_parser("bench", help="benchmarks against the peers")
    kinds = bench.add_subparsers(required=True, metavar="BENCHMARK")
    lookahead = kinds.add_parser("lookahead", help="speculative decoding vs transformers")
    lookahead.add_argument("--prompts", help="JSON list of prompts (default: built-in RAG QA)")
    lookahead.add_argument("--model", default=DEFAULT_MODEL,
                           help="embedded name or model folder: your model's tokens against "
                                "generate's, and its speed")
    lookahead.add_argument("--json", dest="json_out", help="write the report here")
    lookahead.add_argument("--max-new-tokens", type=int, default=128)
    lookahead.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    lookahead.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                           help="model dtype (bfloat16: ours runs exact numerics)")
    lookahead.add_argument("--compiled", action="store_true",
                           help="also our decoder with torch.compile'd steps (compiles for "
                                "minutes on a CPU)")
    lookahead.add_argument("--draft-head", action="store_true",
                           help="also our decoder drafting with the trained draft head, "
                                "alone and merged with the trie, "
                                "compiled too with --compiled (train it first: rag-spec "
                                "draft train --head, about an hour and a half on a CPU; the "
                                "embedded model ships its own)")
    lookahead.add_argument("--peer", choices=["llama.cpp"], default=None,
                           help="also plain llama.cpp on the model's GGUF file (1 and 2 "
                                "threads; llama-cpp-python installed) beside our decoding "
                                "of the file's own weights, drafting and not")
    lookahead.set_defaults(run=_lookahead)
    structured = kinds.add_parser(
        "structured", help="JSON under a schema: ours vs generate + xgrammar's logits processor")
    structured.add_argument("--model", default=DEFAULT_MODEL, help="embedded name or folder")
    structured.add_argument("--limit", type=int, default=8, help="prompts per set (default 8)")
    structured.add_argument("--max-new-tokens", type=int, default=256)
    structured.add_argument("--json", dest="json_out", help="write the report here")
    structured.set_defaults(run=_structured)
    draft = kinds.add_parser("draft", help="draft models and early exits vs assisted generation")
    draft.add_argument("--layers", type=int, default=8,
                       help="the draft: the model's first N layers (default 8)")
    draft.add_argument("--limit", type=int, default=6, help="prompts per set (default 6)")
    draft.add_argument("--batch", type=int, default=4, help="batch size of the batch runs")
    draft.add_argument("--max-new-tokens", type=int, default=64)
    draft.add_argument("--modes", nargs="+", choices=DRAFT_MODES, default=list(DRAFT_MODES),
                       help="which runs: greedy, sampling and batch (greedy, batched; all by "
                            "default)")
    draft.add_argument("--json", dest="json_out", help="write the report here")
    draft.set_defaults(run=_draft)
    ralm = kinds.add_parser("ralm", help="speculative retrieval vs the naive RaLM loop")
    ralm.add_argument("--retriever", default="exact",
                      choices=["exact", "hnsw", "ivf", "bm25", "milvus"])
    ralm.add_argument("--uri", default=None,
                      help="milvus: a milvus-lite folder or http(s)://host:port (default: "
                           "milvus-lite under the cache)")
    ralm.add_argument("--kb-size", type=int, default=None,
                      help="pad an exact index with labelled random distractors to N vectors")
    ralm.add_argument("--latency-ms", type=float, default=0.0,
                      help="simulated service delay per knowledge-base call")
    ralm.add_argument("--packed", action="store_true",
                      help="exact only: search a packed copy of the vectors (twice the memory; "
                           "batches of up to 16 queries cost about what one does)")
    ralm.add_argument("--questions", help="JSON list of questions (default: built-in)")
    ralm.add_argument("--json", dest="json_out", help="write the report here")
    ralm.add_argument("--limit", type=int, default=6, help="use the first N questions")
    ralm.add_argument("--max-new-tokens", type=int, default=64)
    ralm.add_argument("--served", default=None, metavar="URL",
                      help="drive the embedded model behind this OpenAI-compatible server "
                           "(rag-spec serve) instead of loading it here")
    ralm.set_defaults(run=_ralm)
    knnlm = kinds.add_parser("knnlm", help="speculative kNN-LM vs the naive kNN-LM loop")
    knnlm.add_argument("--retriever", default="exact", choices=["exact", "approx"],
                       help="exact: flat L2 search; approx: IVF-PQ")
    knnlm.add_argument("--kb-size", type=int, default=1_000_000,
                       help="pad the datastore with labelled random distractors to N entries")
    knnlm.add_argument("--k", type=int, default=16, help="neighbours per step")
    knnlm.add_argument("--precision", default="float32", choices=["float32", "float16"],
                       help="exact: keys kept in float16 take half the memory")
    knnlm.add_argument("--nprobe", type=int, default=32, help="approx: IVF lists searched")
    knnlm.add_argument("--limit", type=int, default=6, help="prompts (default 6)")
    knnlm.add_argument("--max-new-tokens", type=int, default=32)
    knnlm.add_argument("--json", dest="json_out", help="write the report here")
    knnlm.add_argument("--compare-keys", action="store_true",
                       help="instead: perplexity with each key on held-out text (pkg:tqdm)")
    knnlm.set_defaults(run=_knnlm)
    longctx = kinds.add_parser("longctx", help="long-context batches: self-speculation (MagicDec)")
    longctx.add_argument("--batch", type=_sizes, default=(1, 4, 8, 16),
                         help="batch sizes, comma-separated (default 1,4,8,16)")
    longctx.add_argument("--context", type=_sizes, default=(1024, 2048, 4096),
                         help="context lengths in tokens, comma-separated (default 1024,2048,4096)")
    longctx.add_argument("--max-new-tokens", type=int, default=64)
    longctx.add_argument("--budget", type=int, default=256,
                         help="KV entries the self-draft reads per row (default 256)")
    longctx.add_argument("--json", dest="json_out", help="write the report here")
    longctx.set_defaults(run=_longctx)
    batch = kinds.add_parser("batch", help="RAG questions answered in batches vs transformers")
    batch.add_argument("--batch", type=int, default=4, help="rows per batch (default 4)")
    batch.add_argument("--limit", type=int, default=None,
                       help="use the first N RAG prompts (default: all)")
    batch.add_argument("--max-new-tokens", type=int, default=64)
    batch.add_argument("--json", dest="json_out", help="write the report here")
    batch.set_defaults(run=_batch)
    for plugin in entry_points(group="rag_spec.benchmarks"):  # e.g. chain (the frameworks)
        plugin.load()(kinds)


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        msg = f"expected positive integers separated by commas (e.g. 1,4,16), got {text!r}"
        raise argparse.ArgumentTypeError(msg)
    return sizes


def _longctx(args: argparse.Namespace) -> int:
    from rag_spec.bench.longctx import run

    if args.max_new_tokens < 1 or args.budget < 8:
        msg = "--max-new-tokens must be at least 1 and --budget at least 8."
        raise RagSpecError(msg)
    run(batches=args.batch, contexts=args.context, max_new_tokens=args.max_new_tokens,
        budget=args.budget, json_out=args.json_out)
    return 0


def _batch(args: argparse.Namespace) -> int:
    from rag_spec.bench.batch import run

    _at_least_one(("--batch", args.batch), ("--max-new-tokens", args.max_new_tokens))
    run(batch=args.batch, limit=args.limit, max_new_tokens=args.max_new_tokens,
        json_out=args.json_out)
    return 0


def _structured(args: argparse.Namespace) -> int:
    from rag_spec.bench.structured import run

    _at_least_one(("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens))
    run(json_out=args.json_out, limit=args.limit, max_new_tokens=args.max_new_tokens,
        model_name=args.model)
    return 0


def _lookahead(args: argparse.Namespace) -> int:
    from rag_spec.bench.lookahead import run

    run(prompts_file=args.prompts, json_out=args.json_out, max_new_tokens=args.max_new_tokens,
        limit=args.limit, model_name=args.model, dtype=args.dtype, compiled=args.compiled,
        draft_head=args.draft_head, peer=args.peer)
    return 0


def _draft(args: argparse.Namespace) -> int:
    from rag_spec.bench.draft import run

    _at_least_one(("--layers", args.layers), ("--limit", args.limit), ("--batch", args.batch),
                  ("--max-new-tokens", args.max_new_tokens))
    run(json_out=args.json_out, max_new_tokens=args.max_new_tokens, limit=args.limit,
        layers=args.layers, batch=args.batch, modes=args.modes)
    return 0


def _knnlm(args: argparse.Namespace) -> int:
    from rag_spec.bench.knnlm import compare_keys, run

    if args.compare_keys:
        compare_keys(k=args.k, json_out=args.json_out)
        return 0
    _at_least_one(("--kb-size", args.kb_size), ("--k", args.k), ("--nprobe", args.nprobe),
                  ("--limit", args.limit), ("--max-new-tokens", args.max_new_tokens))
    if args.precision == "float16" and args.retriever != "exact":
        msg = "--precision float16 applies to exact datastores (IVF-PQ keeps codes)."
        raise RagSpecError(msg)
    run(retriever=args.retriever, kb_size=args.kb_size, k=args.k, limit=args.limit,
        max_new_tokens=args.max_new_tokens, precision=args.precision, nprobe=args.nprobe,
        json_out=args.json_out)
    return 0


def _ralm(args: argparse.Namespace) -> int:
    from rag_spec.bench.ralm import run

    if (args.kb_size or args.packed) and args.retriever != "exact":
        msg = ("--kb-size and --packed apply to exact indexes only; use --retriever exact "
               "(or --latency-ms).")
        raise RagSpecError(msg)
    if args.uri and args.retriever != "milvus":
        msg = "--uri names a Milvus store; use it with --retriever milvus."
        raise RagSpecError(msg)
    run(retriever=args.retriever, kb_size=args.kb_size, latency_ms=args.latency_ms,
        packed=args.packed, questions_file=args.questions, json_out=args.json_out,
        limit=args.limit, max_new_tokens=args.max_new_tokens, uri=args.uri, served=args.served)
    return 0


def _at_least_one(*flags: tuple[str, int]) -> None:
    """Refuse a count flag below 1, naming it, before anything loads."""
    for flag, value in flags:
        if value < 1:
            msg = f"{flag} must be at least 1 (got {value})."
            raise RagSpecError(msg)
