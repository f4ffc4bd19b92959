"""The ``chain`` subcommand of ``rag-spec bench`` (registered as a ``rag_spec.benchmarks``
entry point)."""

from __future__ import annotations

import argparse
from typing import Any


def add_command(kinds: Any) -> None:
    chain = kinds.add_parser("chain", help="LangChain / LlamaIndex RAG: stock vs rag-spec classes")
    chain.add_argument("--json", dest="json_out", help="write the report here")
    chain.add_argument("--limit", type=int, default=12, help="use the first N questions")
    chain.add_argument("--max-new-tokens", type=int, default=128)
    chain.set_defaults(run=_chain)


def add_serve_command(kinds: Any) -> None:
    serve = kinds.add_parser("serve", help="rag-spec serve under 1-16 concurrent OpenAI clients")
    serve.add_argument("--json", dest="json_out", help="write the report here")
    serve.add_argument("--clients", default="1,4,8,16", help="concurrency levels")
    serve.add_argument("--max-new-tokens", type=int, default=64)
    serve.set_defaults(run=_serve)


def add_agent_command(kinds: Any) -> None:
    agent = kinds.add_parser("agent", help="a LangChain agent with tools: generate + xgrammar "
                             "vs ChatLookahead, per task")
    agent.add_argument("--json", dest="json_out", help="write the report here")
    agent.add_argument("--limit", type=int, default=6, help="use the first N tasks")
    agent.add_argument("--max-new-tokens", type=int, default=128)
    agent.set_defaults(run=_agent)


def _chain(args: argparse.Namespace) -> int:
    from rag_spec_chain_bench.chain import run

    run(json_out=args.json_out, limit=args.limit, max_new_tokens=args.max_new_tokens)
    return 0


def _agent(args: argparse.Namespace) -> int:
    from rag_spec_chain_bench.agent import run

    run(json_out=args.json_out, limit=args.limit, max_new_tokens=args.max_new_tokens)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from rag_spec_chain_bench.serve import run

    run(json_out=args.json_out, clients=tuple(int(c) for c in args.clients.split(",")),
        max_new_tokens=args.max_new_tokens)
    return 0
