"""``rag-spec serve``: an OpenAI-compatible server over ``LocalLM``, on FastAPI and uvicorn (the
stack vLLM, SGLang and llama-cpp-python's server use), so every OpenAI client (the ``openai``
SDK, LangChain's ``ChatOpenAI``, LlamaIndex's ``OpenAILike``, curl) gets lossless speculative
decoding.

Routes: ``GET /v1/models``, ``POST /v1/chat/completions`` (streamed as server-sent events
ending in ``[DONE]``; tools; ``response_format``), ``POST /v1/completions``,
``POST /v1/embeddings`` (the knowledge bases' embedder), ``GET /health``. The model loads on
a thread of its own at start-up; until it is ready every route but ``/health`` answers 503.
Requests decode on rag-spec's compute thread (``LocalLM.agenerate``, ``astream``): each joins
the batch in flight at its next step and leaves it when it ends (continuous batching, at most
``max_rows`` rows; the others wait in line), a client that disconnects from a stream frees its
row at the next step, and past ``max_waiting`` requests in flight a request gets 429 with
``Retry-After``. Bad input gets a 4xx with the API's error body and one sentence
that names the fix, never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from collections.abc import AsyncIterator
from typing import Any

from rag_spec.errors import RagSpecError
from rag_spec.serving import openai_api as api
from rag_spec.serving.local_lm import LocalLM

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 2**20


class _State:
    """The model behind the server, once loaded, and the requests in flight."""

    def __init__(self, model: str, max_waiting: int, max_rows: int) -> None:
        self.model = model
        self.max_waiting = max_waiting
        self.max_rows = max_rows
        self.lm: LocalLM | None = None
        self.failed: str | None = None
        self.in_flight = 0
        self.ready = threading.Event()

    def load(self, load_kwargs: dict[str, Any]) -> None:
        try:
            log.info("rag-spec serve: loading %s", self.model)
            self.lm = LocalLM.shared(self.model, max_batch=self.max_rows, **load_kwargs)
            log.info("rag-spec serve: %s is ready", self.model)
        except Exception as err:  # reported by every request, and in the log
            self.failed = f"{type(err).__name__}: {err}"
            log.error("rag-spec serve: %s did not load (%s)", self.model, self.failed)
        finally:
            self.ready.set()


def create_app(model: str | None = None, *, api_key: str | None = None,
               max_waiting: int = 32, max_rows: int = 8,
               load_kwargs: dict[str, Any] | None = None, background: bool = True) -> Any:
    """The ASGI application. ``model``: an embedded name or a local folder (default: the
    embedded model); ``api_key``: checked on every route but ``/health``; ``background``:
    load the model on a thread (the server answers 503 meanwhile), else before returning."""
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    from rag_spec.models.registry import DEFAULT_MODEL

    state = _State(model or DEFAULT_MODEL, max_waiting, max_rows)
    loader = threading.Thread(target=state.load, args=(dict(load_kwargs or {}),),
                              name="rag-spec-load", daemon=True)
    if background:
        loader.start()
    else:
        loader.run()
    app = FastAPI(title="rag-spec", docs_url=None, redoc_url=None)
    app.state.rag_spec = state

    def failure(status: int, message: str, kind: str = "invalid_request_error",
                param: str | None = None, headers: dict[str, str] | None = None) -> Any:
        return JSONResponse(api.error_body(message, kind, param), status_code=status,
                            headers=headers)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if request.url.path != "/health":
            if api_key is not None:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    return failure(401, "Missing or wrong API key: send the header "
                                   "'Authorization: Bearer <key>' with the key the server was "
                                   "started with.", "authentication_error")
            length = request.headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
                return failure(413, f"The request body is over {MAX_BODY_BYTES} bytes: send "
                               f"a shorter prompt.")
            if not state.ready.is_set() or state.lm is None:
                reason = state.failed or "the model is loading"
                return failure(503, f"Not ready: {reason}; try again shortly.",
                               "service_unavailable", headers={"Retry-After": "5"})
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> Any:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        if first.get("type") == "json_invalid":
            return failure(400, "The body is not valid JSON: send a JSON object.")
        if first.get("type") == "extra_forbidden":
            return failure(400, f"Unknown field {where!r}: remove it (rag-spec serves the "
                           f"OpenAI API's fields).", param=where)
        return failure(400, f"{where or 'body'}: {first.get('msg')}; fix that field.",
                       param=where or None)

    @app.exception_handler(RagSpecError)
    async def refused(request: Request, error: RagSpecError) -> Any:
        return failure(400, str(error))

    @app.exception_handler(Exception)
    async def crashed(request: Request, error: Exception) -> Any:
        log.exception("rag-spec serve: %s failed", request.url.path)
        return failure(500, f"The server failed on this request ({type(error).__name__}); "
                       f"its log has the details.", "server_error")

    def lm_for(name: str | None) -> LocalLM:
        assert state.lm is not None
        if name not in (None, "", state.model, state.lm.name):
            msg = f"The model {name!r} is not served here; use {state.model!r} (GET /v1/models)."
            raise _NotFound(msg)
        return state.lm

    @app.exception_handler(_NotFound)
    async def missing(request: Request, error: _NotFound) -> Any:
        return failure(404, str(error), param="model", kind="invalid_request_error")

    @app.exception_handler(_Busy)
    async def busy(request: Request, error: _Busy) -> Any:
        return failure(429, str(error), "rate_limit_error", headers={"Retry-After": "1"})

    @app.get("/health")
    async def health() -> Any:
        if state.failed:
            return JSONResponse({"status": "failed", "reason": state.failed}, status_code=503)
        return {"status": "ok" if state.lm is not None else "loading", "model": state.model}

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": state.model, "object": "model",
                                            "created": 0, "owned_by": "rag-spec"}]}

    @app.post("/reset_prefix_cache")  # vLLM's route for the same
    async def reset_prefix_cache() -> Any:
        assert state.lm is not None
        return {"status": "ok", "forgotten_prompts": state.lm.forget_prefixes()}

    @app.post("/v1/chat/completions")
    async def chat(request: api.ChatRequest) -> Any:
        lm = lm_for(request.model)
        return await generate(lm, request, request.grammar(), chat=True)

    @app.post("/v1/completions")
    async def completions(request: api.CompletionRequest) -> Any:
        lm = lm_for(request.model)
        return await generate(lm, request, {}, chat=False)

    @app.post("/v1/embeddings")
    async def embeddings(request: api.EmbeddingRequest) -> Any:
        from rag_spec.retrieval.embedder import DEFAULT_EMBEDDER, Embedder
        from rag_spec.threads import run_in_compute_thread

        texts = request.texts()
        embedder = Embedder.default()
        vectors = await run_in_compute_thread(embedder.encode, texts)
        tokens = sum(len(t.split()) for t in texts)
        return api.embeddings_response(vectors, request.model or DEFAULT_EMBEDDER, tokens,
                                       request.encoding_format)

    async def generate(lm: LocalLM, request: Any, grammar: dict[str, Any], chat: bool) -> Any:
        prompt = api.prompt_of(request)
        prompt_tokens = len(await asyncio.to_thread(lm.encode, prompt, grammar.get("tools")))
        options = request.options(prompt_tokens, lm.context_window, request.limit, **grammar)
        request_id = api.new_id("chatcmpl" if chat else "cmpl")
        if state.in_flight >= state.max_waiting:
            msg = (f"{state.in_flight} requests are in flight, the most this server takes "
                   f"(--max-waiting); retry in a moment.")
            raise _Busy(msg)
        if request.stream:
            events = (_chat_events if chat else _text_events)(
                lm, prompt, options, request_id, state.model, request.usage_in_stream)
            return StreamingResponse(_counted(state, events), media_type="text/event-stream")
        state.in_flight += 1
        try:
            completion = (await lm.agenerate([prompt], options))[0]
        finally:
            state.in_flight -= 1
        if chat:
            return api.chat_response(completion, state.model, request_id)
        return api.text_response(completion, state.model, request_id,
                                 _echoed(lm, request.prompt) if request.echo else "")

    return app


class _NotFound(Exception):
    """An unknown model (404)."""


class _Busy(Exception):
    """Too many requests in flight (429)."""


async def _counted(state: _State, events: AsyncIterator[str]) -> AsyncIterator[str]:
    """``events``, counted in flight while they stream; a client that disconnects closes the
    stream, which stops its generation at the next step."""
    state.in_flight += 1
    try:
        async for event in events:
            yield event
    finally:
        state.in_flight -= 1


def _event(payload: Any) -> str:
    return f"data: {json.dumps(payload)}\n\n"


async def _chat_events(lm: LocalLM, prompt: Any, options: Any, request_id: str, model: str,
                       usage: bool) -> AsyncIterator[str]:
    """A chat answer as server-sent events: the role, the text as it settles (with tools
    offered, the whole answer at its end, once it is known to be calls or text), the finish
    reason with the speculation's statistics, the usage where asked, ``[DONE]``."""
    yield _event(api.chat_chunk(request_id, model, {"role": "assistant", "content": ""}))
    held = bool(options.tools)
    async for chunk in lm.astream(prompt, options):
        if chunk.completion is None:
            if chunk.text and not held:
                yield _event(api.chat_chunk(request_id, model, {"content": chunk.text}))
            continue
        done = chunk.completion
        if held:
            message = api.chat_message(done)
            delta = {"content": message["content"]}
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": i, **call}
                                       for i, call in enumerate(message["tool_calls"])]
            yield _event(api.chat_chunk(request_id, model, delta))
        elif chunk.text:
            yield _event(api.chat_chunk(request_id, model, {"content": chunk.text}))
        yield _event(api.chat_chunk(request_id, model, {}, done.api_finish_reason,
                                    extra=done.speculation()))
        if usage:
            yield _event(api.chat_chunk(request_id, model, {}, usage=done.usage()))
    yield "data: [DONE]\n\n"


async def _text_events(lm: LocalLM, prompt: Any, options: Any, request_id: str, model: str,
                       usage: bool) -> AsyncIterator[str]:
    async for chunk in lm.astream(prompt, options):
        if chunk.completion is None:
            if chunk.text:
                yield _event(api.text_chunk(request_id, model, chunk.text))
            continue
        done = chunk.completion
        final = api.text_chunk(request_id, model, chunk.text, done.api_finish_reason, done)
        if usage:
            final["usage"] = done.usage()
        yield _event(final)
    yield "data: [DONE]\n\n"


class Server:
    """``rag-spec serve`` inside this process, on a thread of its own, for a notebook or a
    test: ``with Server() as server: ChatOpenAI(base_url=server.url + "/v1", ...)``. It listens
    on 127.0.0.1 (``port=0``: a free port) and stops when the block ends. ``app``: an
    application ``create_app`` made, served as it is."""

    def __init__(self, model: str | None = None, *, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, max_waiting: int = 32, max_rows: int = 8,
                 app: Any = None) -> None:
        import uvicorn

        self.app = app if app is not None else create_app(
            model, api_key=api_key, max_waiting=max_waiting, max_rows=max_rows,
            background=False)
        self._server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, name="rag-spec-serve",
                                        daemon=True)
        self.url = ""

    def start(self) -> Server:
        """Listen; returns once the socket is open (``url`` then says where)."""
        self._thread.start()
        while not self._server.started:
            if not self._thread.is_alive():
                msg = "rag-spec serve did not start: its log says why (a port in use?)."
                raise RagSpecError(msg)
            self._thread.join(0.01)
        host, port = self._server.servers[0].sockets[0].getsockname()[:2]
        self.url = f"http://{host}:{port}"
        return self

    def stop(self) -> None:
        """Stop taking requests, finish those in flight, close."""
        self._server.should_exit = True
        self._thread.join()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          api_key: str | None = None, max_waiting: int = 32, max_rows: int = 8,
          load_kwargs: dict[str, Any] | None = None) -> None:
    """Run the server until SIGINT / SIGTERM (uvicorn stops taking requests, finishes those
    in flight, then exits). Loopback by default; elsewhere without a key, a warning."""
    import uvicorn

    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        log.warning("rag-spec serve: listening on %s without an API key: anyone who reaches "
                    "this address can use the model. Pass --api-key (or set "
                    "RAG_SPEC_API_KEY).", host)
    app = create_app(model, api_key=api_key, max_waiting=max_waiting, max_rows=max_rows,
                     load_kwargs=load_kwargs)
    uvicorn.run(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=30)


def _echoed(lm: LocalLM, prompt: str | list[int]) -> str:
    """A completion prompt as text (token ids decoded), for ``echo``."""
    return prompt if isinstance(prompt, str) else lm.lm.tokenizer.decode(prompt)
