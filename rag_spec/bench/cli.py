"""``rag-spec bench ...`` subcommands."""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_commands(commands: Any) -> None:
    bench = commands.add_parser("bench", help="benchmarks against the peers")
    kinds = bench.add_subparsers(required=True, metavar="BENCHMARK")
    lookahead = kinds.add_parser("lookahead", help="speculative decoding vs transformers")
    lookahead.add_argument("--prompts", help="JSON list of prompts (default: built-in RAG QA)")
    lookahead.add_argument("--json", dest="json_out", help="write the report here")
    lookahead.add_argument("--max-new-tokens", type=int, default=128)
    lookahead.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    lookahead.set_defaults(run=_lookahead)


def _lookahead(args: argparse.Namespace) -> int:
    from rag_spec.bench.lookahead import run

    run(prompts_file=args.prompts, json_out=args.json_out, max_new_tokens=args.max_new_tokens,
        limit=args.limit)
    return 0
