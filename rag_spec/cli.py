"""The ``rag-spec`` command: ask, index, models, bench."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any

from rag_spec.errors import IncompleteOutputWarning, RagSpecError

DEFAULT_QUESTION = "How do I join two path components with os.path?"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; user errors print one paragraph and exit 2, never a traceback."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except RagSpecError as err:
        print(f"rag-spec: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _ask(args: argparse.Namespace) -> int:
    from rag_spec.models import load_model
    from rag_spec.models.loader import resolve_device
    from rag_spec.models.registry import DEFAULT_MODEL
    from rag_spec.serving.ask import ask, ask_served
    from rag_spec.serving.drafts import check_draft, drafter_for
    from rag_spec.serving.served_model import ServedModel

    if args.question is None:
        print(f"rag-spec: no question given: asking the demo question ({DEFAULT_QUESTION!r}). "
              f'Ask your own: rag-spec ask "..."', file=sys.stderr)
        args.question = DEFAULT_QUESTION
    if not args.question.strip():
        msg = 'The question is empty. Ask something, e.g. rag-spec ask "How do I join paths?"'
        raise RagSpecError(msg)
    if args.json and args.json_schema is None:
        msg = ("--json prints the answer's JSON alone: give the schema it follows, "
               "--json-schema FILE.")
        raise RagSpecError(msg)
    for flag, value in (("--k", args.k), ("--max-new-tokens", args.max_new_tokens)):
        if value < 1:
            msg = f"{flag} must be at least 1 (got {value})."
            raise RagSpecError(msg)
    resolve_device(args.device)  # bad flags fail before anything loads
    check_draft(args.draft)
    _check_backend_flags(args)
    _check_served_flags(args)
    schema = _json_schema(args.json_schema)
    started = time.perf_counter()
    if args.served is None:
        lm = load_model(args.model or DEFAULT_MODEL, device=args.device)
        drafter = drafter_for(args.draft, lm)  # loads a trained draft, never trains one
    kb = _knowledge_base(args, args.kind)
    # with --json, standard output holds the answer's JSON alone: everything else is a report
    report = sys.stderr if args.json else sys.stdout
    ready = f"{kb.kind} index" if args.served else f"model and {kb.kind} index"
    print(f"({ready} ready in {time.perf_counter() - started:.1f} s)\n", file=report)
    print(f"Q: {args.question}", file=report)
    started_answer = []

    def show(piece: str) -> None:  # "A:" once text comes: an error before it stands alone
        if not started_answer:
            started_answer.append(True)
            print("A: ", end="")
        print(piece, end="", flush=True)

    on_text = None if args.json else show
    if args.served is not None:
        served = ServedModel(args.served, model=args.model, api_key=args.api_key)
        answer = ask_served(served, kb, args.question, k=args.k,
                            max_new_tokens=args.max_new_tokens, on_text=on_text,
                            json_schema=schema)
    else:
        with warnings.catch_warnings():  # a cut answer is this command's error, below
            warnings.simplefilter("ignore", IncompleteOutputWarning)
            answer = ask(lm, kb, args.question, k=args.k, max_new_tokens=args.max_new_tokens,
                         on_text=on_text, draft=drafter, json_schema=schema,
                         quantized=args.quantized)
    if schema is not None and answer.finish_reason == "length":
        print(file=report)
        msg = (f"The answer was cut at --max-new-tokens {args.max_new_tokens} before its JSON "
               f"closed: it does not follow the schema. Raise --max-new-tokens.")
        raise RagSpecError(msg)
    if args.json:
        print(answer.text.strip())
    print("\n\nSources:", file=report)
    for i, hit in enumerate(answer.hits, 1):
        preview = hit.text[:100] + ("..." if len(hit.text) > 100 else "")
        print(f"  [{i}] {hit.title} (score {hit.score:.3f}): {preview}", file=report)
    stats = answer.stats
    if args.served is not None:
        tokens = stats["completion_tokens"]
        speed = "" if tokens is None else (
            f"{tokens} tokens, {tokens / max(answer.generation_seconds, 1e-9):.1f} tok/s, ")
        cached = "" if stats["cached_tokens"] is None else (
            f", {stats['cached_tokens']} of its {stats['prompt_tokens']} prompt tokens read "
            f"from its prefix cache")
        print(f"\n{speed}{answer.generation_seconds:.2f} s from {args.served}{cached}; "
              f"retrieval {answer.retrieval_seconds * 1000:.0f} ms", file=report)
        return 0
    print(f"\n{len(answer.token_ids)} tokens in {answer.generation_seconds:.2f} s "
          f"({answer.tokens_per_second:.1f} tok/s, {stats['tokens_per_step']:.2f} tokens per "
          f"forward pass, drafts: {stats['drafts'] or 'none'}, {stats['passes']} steps on "
          f"{stats['weights']} weights); "
          f"retrieval {answer.retrieval_seconds * 1000:.0f} ms", file=report)
    return 0


def _check_served_flags(args: argparse.Namespace) -> None:
    """--served answers on the server: the flags that choose how a local model decodes do
    not apply there, and --api-key only applies there."""
    if args.served is None:
        if args.api_key is not None:
            msg = "--api-key is the served model's key: give the server's address, --served URL."
            raise RagSpecError(msg)
        return
    local = [flag for flag, given in (("--draft", args.draft is not None),
                                      ("--device", args.device is not None),
                                      ("--quantized / --float32", args.quantized != "auto"))
             if given]
    if local:
        msg = (f"{', '.join(local)} choose how a local model decodes; with --served the server "
               f"decodes: leave them out, or drop --served.")
        raise RagSpecError(msg)


def _json_schema(path: str | None) -> Any:
    """The schema in ``path`` (a JSON file), read before anything loads."""
    if path is None:
        return None
    import json
    from pathlib import Path

    try:
        schema = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        msg = f"--json-schema {path}: cannot read a JSON schema there ({err})."
        raise RagSpecError(msg) from err
    if not isinstance(schema, dict):
        msg = f"--json-schema {path}: a JSON schema is an object, not {type(schema).__name__}."
        raise RagSpecError(msg)
    return schema


def _index_build(args: argparse.Namespace) -> int:
    # Milvus keeps one collection per corpus: "all" builds its default index.
    every = ["flat", "hnsw", "ivf", "bm25"] if args.backend == "local" else [None]
    kinds = every if args.kind == "all" else [args.kind]
    _check_backend_flags(args)
    for kind in kinds:
        started = time.perf_counter()
        kb = _knowledge_base(args, kind, rebuild=args.rebuild)
        print(f"{kb.kind}: {len(kb)} passages, ready in {time.perf_counter() - started:.1f} s")
    return 0


MILVUS_KINDS = ["hnsw", "flat"]


def _knowledge_base(args: argparse.Namespace, kind: str | None, rebuild: bool = False) -> Any:
    """The knowledge base the flags name: local (faiss, BM25; flat unless ``kind``) or in
    Milvus (the serving collection's index, hnsw for a new one, unless ``kind``)."""
    from rag_spec.retrieval import KnowledgeBase

    sources = args.source or ["stdlib"]
    if args.backend == "local":
        return KnowledgeBase.open(sources, kind or "flat", rebuild=rebuild)
    from rag_spec.retrieval.milvus import MilvusKnowledgeBase

    _quiet_pymilvus()
    if kind not in (None, *MILVUS_KINDS):
        msg = f"Milvus indexes are {' or '.join(MILVUS_KINDS)}; --kind {kind} is local only."
        raise RagSpecError(msg)
    return MilvusKnowledgeBase.open(sources, uri=args.uri, token=args.token, index=kind,
                                    rebuild=rebuild)


def _quiet_pymilvus() -> None:
    """pymilvus logs each failed call with its traceback before it raises; this command says
    what failed and how to fix it in one paragraph. (Importing pymilvus configures its
    logger, so the level is set after.)"""
    try:
        import pymilvus  # noqa: F401
    except ImportError:  # MilvusKnowledgeBase.open names the install command
        return
    logging.getLogger("pymilvus").setLevel(logging.CRITICAL)


def _check_backend_flags(args: argparse.Namespace) -> None:
    """Flags that would be ignored are refused, before anything loads."""
    from rag_spec.retrieval.milvus import is_server

    if args.backend == "local" and (args.uri or args.token):
        msg = "--uri and --token name a Milvus store; add --backend milvus."
        raise RagSpecError(msg)
    if args.token and not (args.uri and is_server(args.uri)):
        msg = ("--token is a Milvus server's; give the server with --uri http(s)://host:port "
               "(a local milvus-lite folder takes no token).")
        raise RagSpecError(msg)


def _add_backend_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="local", choices=["local", "milvus"],
                        help="where passages live: this process (faiss, BM25) or Milvus")
    parser.add_argument("--uri", default=None,
                        help="milvus: a milvus-lite folder (default: under the cache) or "
                             "http(s)://host:port of a Milvus server or cluster")
    parser.add_argument("--token", default=None, help="milvus: the server's token, if any")


def _models_pull(args: argparse.Namespace) -> int:
    import torch

    from rag_spec.models import load_model
    from rag_spec.models.embedded import pull
    from rag_spec.target.gguf import file_weights
    from rag_spec_kernels import (
        cpu_attention_available,
        quantized_available,
        row_attention_available,
        streamed_available,
    )

    started = time.perf_counter()
    path = pull(args.name, force=args.force)
    print(f"{args.name}: {path} ({time.perf_counter() - started:.1f} s)")
    # the CPU kernels built now where this CPU takes them, not in a first answer; the GGUF
    # file's blocks converted once (kept in the cache) where its weights will decode (the
    # compile below converts them for its package)
    streamed_available(torch.float32)
    cpu_attention_available()
    if args.no_compile and quantized_available() and row_attention_available():
        file_weights(load_model(args.name).model)
    return 0 if args.no_compile else _models_compile(args)


def _models_compile(args: argparse.Namespace) -> int:
    from rag_spec.engine.decoder import LookaheadConfig, LookaheadDecoder
    from rag_spec.models import load_model
    from rag_spec.target.gguf import source_file

    lm = load_model(args.name)
    # a model loaded from a GGUF file has a second set of steps: on the file's own weights
    settings = [LookaheadConfig(quantized=False), *([LookaheadConfig(quantized=True)]
                                                    if source_file(lm.model) is not None
                                                    else [])]
    for config in settings:
        weights = "the GGUF file's weights" if config.quantized else "float32 weights"
        started = time.perf_counter()
        try:
            folder = LookaheadDecoder(lm.model, lm.tokenizer, config).package_steps()
        except Exception as error:  # an optimisation: answers still decode, eagerly
            print(f"rag-spec: could not compile {args.name}'s decoding steps on {weights} "
                  f"ahead of time ({type(error).__name__}: {error}); answers decode with eager "
                  "steps.", file=sys.stderr)
            continue
        print(f"{args.name}: compiled decoding steps on {weights} in {folder} "
              f"({time.perf_counter() - started:.0f} s; every later process loads them)")
    return 0


def _models_list(args: argparse.Namespace) -> int:
    from rag_spec.models.embedded import is_pulled
    from rag_spec.models.registry import EMBEDDED_MODELS

    for name, spec in EMBEDDED_MODELS.items():
        state = "pulled" if is_pulled(name) else "not pulled"
        print(f"{name:24} {state:11} {spec.description} [{spec.requirement}]")
    return 0


def _draft_train(args: argparse.Namespace) -> int:
    from rag_spec.models import load_model
    from rag_spec.training.train_exit import cached_exit

    for flag, value, least in (("--layers", args.layers, 1), ("--texts", args.texts, 1),
                               ("--answers", args.answers, 0), ("--written", args.written, 0)):
        if value < least:
            msg = f"{flag} must be at least {least} (got {value})."
            raise RagSpecError(msg)
    started = time.perf_counter()
    lm = load_model(args.model)
    if args.head:
        from rag_spec.training.train_head import cached_head

        head = cached_head(lm, args.source or ["stdlib"], texts=args.texts, answers=args.answers,
                           written=args.written)
        before, after = head.agreement["untrained"], head.agreement["trained"]
        print(f"draft head: the model's next token is the head's first guess "
              f"{before['top1']:.1%} of the time untrained, {after['top1']:.1%} trained "
              f"(among its four likeliest: {after['top4']:.1%}; a token further, fed its own "
              f"guessed state: {after.get('top1_depth2', 0.0):.1%}; {len(head.subset)}-token head; "
              f"{time.perf_counter() - started:.0f} s). Use it: rag-spec ask --draft head")
        return 0
    adapter = cached_exit(lm, args.layers, args.source or ["stdlib"], texts=args.texts,
                          answers=args.answers)
    agreement = adapter.agreement
    print(f"exit after {args.layers} layers: the draft's greedy token is the model's "
          f"{agreement['untrained']:.1%} of the time untrained, {agreement['trained']:.1%} "
          f"trained ({len(adapter.subset)}-token head; {time.perf_counter() - started:.0f} s). "
          f"Use it: rag-spec ask --draft trained-exit:{args.layers}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from rag_spec.serving.server import serve
    except ImportError as err:
        msg = (f"rag-spec serve needs FastAPI and uvicorn ({err}); install them with: "
               f"pip install 'rag-spec[serve]'.")
        raise RagSpecError(msg) from err
    for flag, value in (("--max-waiting", args.max_waiting), ("--max-rows", args.max_rows)):
        if value < 1:
            msg = f"{flag} must be at least 1 (got {value})."
            raise RagSpecError(msg)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s: %(message)s")
    serve(args.model, host=args.host, port=args.port,
          api_key=args.api_key or os.environ.get("RAG_SPEC_API_KEY"),
          max_waiting=args.max_waiting, max_rows=args.max_rows)
    return 0


def _parser() -> argparse.ArgumentParser:
    from rag_spec.models.registry import DEFAULT_MODEL
    from rag_spec.serving.drafts import DRAFT_HELP

    parser = argparse.ArgumentParser(prog="rag-spec", description=(
        "Faster retrieval-augmented generation on local models, with unchanged output."))
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    ask = commands.add_parser("ask", help="answer a question from the knowledge base")
    ask.add_argument("question", nargs="?", default=None,
                     help=f"what to ask (default: the demo question, {DEFAULT_QUESTION!r})")
    ask.add_argument("--k", type=int, default=3, help="passages to retrieve (default 3)")
    ask.add_argument("--kind", default=None, choices=["flat", "hnsw", "ivf", "bm25"],
                     help="index (default: flat; with --backend milvus, the collection's)")
    ask.add_argument("--source", action="append",
                     help="corpus: stdlib, pkg:NAME or a folder (repeatable; default stdlib)")
    ask.add_argument("--model", default=None,
                     help=f"embedded name, model folder or .gguf file (default {DEFAULT_MODEL}); "
                     "with --served, the served model's name (default: the server's one)")
    ask.add_argument("--served", default=None, metavar="URL",
                     help="answer with the model behind an OpenAI-compatible server at URL "
                     "(rag-spec serve, llama.cpp's server, vLLM, Ollama); the passages are "
                     "retrieved here")
    ask.add_argument("--api-key", default=None, help="with --served: the server's API key")
    weights = ask.add_mutually_exclusive_group()
    weights.add_argument("--quantized", dest="quantized", action="store_const", const=True,
                         default="auto",
                         help="require decoding from the model's GGUF weights as they are "
                              "(the embedded model, or --model x.gguf; the default wherever "
                              "it applies): another model than its float32 one, whose answers "
                              "equal its own decoding without drafts")
    weights.add_argument("--float32", dest="quantized", action="store_const", const=False,
                         help="decode the de-quantised float32 weights instead: answers equal "
                              "transformers' generate on the same model")
    ask.add_argument("--device", default=None, help="cpu, cuda, ... (default: auto)")
    ask.add_argument("--max-new-tokens", type=int, default=256)
    ask.add_argument("--draft", default=None,
                     help=f"draft with {DRAFT_HELP}; default: the model's draft head + the "
                     "trie where it has one (the embedded model does), else the trie")
    ask.add_argument("--json-schema", default=None, metavar="FILE",
                     help="answer as JSON following the JSON schema in FILE (constrained "
                     "decoding, speculated; at most one whitespace character a place)")
    ask.add_argument("--json", action="store_true",
                     help="with --json-schema: print the answer's JSON alone on standard "
                     "output (for a pipe); the question, sources and speed go to standard error")
    _add_backend_flags(ask)
    ask.set_defaults(run=_ask)

    serve = commands.add_parser("serve", help="an OpenAI-compatible server (chat, completions, "
                                "embeddings) decoding speculatively")
    serve.add_argument("--model", default=DEFAULT_MODEL, help="embedded name or model folder")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                       "loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' "
                       "(default: $RAG_SPEC_API_KEY, else none)")
    serve.add_argument("--max-waiting", type=int, default=32,
                       help="requests in flight before new ones get 429 (default 32)")
    serve.add_argument("--max-rows", type=int, default=8,
                       help="requests decoding at once in the batch in flight; the others "
                       "wait in line (default 8)")
    serve.set_defaults(run=_serve)

    index = commands.add_parser("index", help="build knowledge-base indexes")
    index_commands = index.add_subparsers(required=True, metavar="ACTION")
    build = index_commands.add_parser("build", help="build and save an index")
    build.add_argument("--source", action="append",
                       help="corpus: stdlib, pkg:NAME or a folder (repeatable; default stdlib)")
    build.add_argument("--kind", default=None, choices=["flat", "hnsw", "ivf", "bm25", "all"],
                       help="index (default: flat; with --backend milvus, hnsw)")
    build.add_argument("--rebuild", action="store_true", help="rebuild even if saved")
    _add_backend_flags(build)
    build.set_defaults(run=_index_build)

    models = commands.add_parser("models", help="embedded models")
    model_commands = models.add_subparsers(required=True, metavar="ACTION")
    pull = model_commands.add_parser("pull", help="fetch and convert an embedded model")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    pull.add_argument("--force", action="store_true", help="convert again")
    pull.add_argument("--no-compile", action="store_true",
                      help="skip compiling its decoding steps ahead of time (~3 min on two "
                           "cores, once per machine; without them answers decode eagerly)")
    pull.set_defaults(run=_models_pull)
    compiling = model_commands.add_parser(
        "compile", help="compile a model's decoding steps ahead of time (once per machine)")
    compiling.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    compiling.set_defaults(run=_models_compile)
    listing = model_commands.add_parser("list", help="list embedded models")
    listing.set_defaults(run=_models_list)

    draft = commands.add_parser("draft", help="self-drafts")
    draft_commands = draft.add_subparsers(required=True, metavar="ACTION")
    train = draft_commands.add_parser(
        "train", help="train an early-exit adapter, or with --head a draft head (cached)")
    train.add_argument("--head", action="store_true",
                       help="a draft head on the model's last hidden states (EAGLE-style; "
                       "--layers is ignored)")
    train.add_argument("--source", action="append",
                       help="corpus: stdlib, pkg:NAME or a folder (repeatable; default stdlib)")
    train.add_argument("--layers", type=int, default=8, help="exit after N layers (default 8)")
    train.add_argument("--texts", type=int, default=800, help="passages to train on")
    train.add_argument("--answers", type=int, default=240,
                       help="the model's own answers to train on too (default 240; 0: none)")
    train.add_argument("--written", type=int, default=1200,
                       help="with --head: longer answers to questions the model writes itself "
                       "(default 1200; 0: none)")
    train.add_argument("--model", default=DEFAULT_MODEL, help="embedded name or model folder")
    train.set_defaults(run=_draft_train)

    from rag_spec.bench.cli import add_bench_commands

    add_bench_commands(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
