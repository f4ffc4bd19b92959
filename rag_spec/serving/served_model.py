"""A model behind an OpenAI-compatible server, as iterative RaLM's generator.

RaLMSpec's loop needs three things of a generator: continue a prefix for a stride, stop, and
continue another prefix after a rollback. ``ServedModel`` does them over HTTP: the prompt is
rendered and tokenized here, with the served model's own tokenizer (its chat template), and
each stride is ``POST /v1/completions`` with the prompt as token ids, greedy, ``max_tokens``
the stride, so that a rollback re-sends exactly the kept prefix. Strides stream: one that a
wrong guess behind it has made useless is cancelled by closing its connection (the server stops
decoding it). The answer's token ids come back in the last chunk's ``rag_spec`` field
(``rag-spec serve`` sends them); a server that sends
only text cannot be driven exactly (text does not tokenize back to the same ids) and is named
as such. The server decodes each request from its prompt: a server that caches prompt
prefixes (vLLM's automatic prefix caching, llama.cpp's ``cache_prompt``, ``rag-spec serve`` on
GGUF weights) re-processes only the tokens after a change, and says how many it read
(``usage.prompt_tokens_details.cached_tokens``).

``ServedModel.chat`` is the plain chat route, streamed, for one-shot RAG against any
OpenAI-compatible server (``rag-spec ask --served``).

``ServedState`` is ``RalmState`` for a served model: the same output, segments, rollback and
bookkeeping, with no cache on this side (the server holds it).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import socket
import time
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from rag_spec.errors import RagSpecError
from rag_spec.retrieval.types import Hit
from rag_spec.serving.ralm_state import Segment, SegmentHistory
from rag_spec.speculation import Cancel


@dataclass(frozen=True)
class ServedAnswer:
    """A served chat answer: its text, why it ended (the API's words) and the server's token
    counts (``usage``, where it sent them)."""

    text: str
    finish_reason: str
    usage: dict[str, Any]


@dataclass(frozen=True)
class Continuation:
    """A served stride: its token ids, why it ended, and the prompt the server read (and of
    it, what it read from its prefix cache, where it says)."""

    token_ids: list[int]
    finish_reason: str  # the API's "stop" (the answer's end) or "length"; or "cancelled"
    prompt_tokens: int
    cached_tokens: int = 0


class ServedModel:
    """A model served behind an OpenAI-compatible server, driven by token ids; what
    ``IterativeRaLM`` takes in place of a loaded model.

    Args:
        base_url: the server's address, e.g. ``http://127.0.0.1:8000`` (``/v1`` optional).
        model: the model name the server knows (None: the server's only one).
        api_key: sent as ``Authorization: Bearer``; None: none.
        tokenizer: the served model's tokenizer (an object, or a local folder); None: the
            embedded default model's (what ``rag-spec serve`` serves by default).
        timeout: seconds a request may take.

    Examples:
        >>> served = ServedModel("http://127.0.0.1:8000")                   # doctest: +SKIP
        >>> rag_spec.IterativeRaLM(served, rag_spec.SpecRetriever(kb))       # doctest: +SKIP
    """

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 tokenizer: Any = None, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self._tokenizer = tokenizer

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The served model's tokenizer, loaded at first use (``chat`` needs none)."""
        return _tokenizer(self._tokenizer)

    @property
    def eos_token_ids(self) -> list[int]:
        eos = self.tokenizer.eos_token_id
        return [] if eos is None else [eos]

    def chat(self, messages: Sequence[dict[str, str]], max_tokens: int = 256, *,
             on_text: Callable[[str], None] | None = None, json_schema: Any = None
             ) -> ServedAnswer:
        """A greedy answer to ``messages`` on ``/v1/chat/completions``, streamed: each piece
        of text goes to ``on_text`` as the server sends it; under ``json_schema`` (a dict)
        through the API's ``response_format``. Any OpenAI-compatible server."""
        body: dict[str, Any] = {"messages": list(messages), "max_tokens": max_tokens}
        if json_schema is not None:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": json_schema, "strict": True}}
        pieces, reason, usage = [], "length", {}
        for chunk in self._events("/v1/chat/completions", body):
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    pieces.append(piece)
                    if on_text is not None:
                        on_text(piece)
                reason = choice.get("finish_reason") or reason
        return ServedAnswer("".join(pieces), reason, usage)

    def complete(self, token_ids: Sequence[int], max_tokens: int,
                 cancel: Cancel | None = None) -> Continuation:
        """Greedy tokens after ``token_ids``: at most ``max_tokens``, fewer at the answer's
        end (its end-of-answer token included, as a loaded model's decoding has it). Streamed:
        once ``cancel`` is set the stream is closed, which stops the server's decoding of it,
        and nothing comes back (``finish_reason`` "cancelled")."""
        cancel = cancel or Cancel()
        cancelled = Continuation([], "cancelled", 0)
        if cancel.is_set():
            return cancelled
        final: dict[str, Any] = {}
        reason, usage = "length", {}
        try:
            for chunk in self._events("/v1/completions", {"prompt": list(token_ids),
                                                          "max_tokens": max_tokens}, cancel):
                usage = chunk.get("usage") or usage
                final = chunk.get("rag_spec") or final
                for choice in chunk.get("choices") or ():
                    reason = choice.get("finish_reason") or reason
        except _Cancelled:
            return cancelled
        if "token_ids" not in final:
            msg = (f"The server at {self.base_url} answered a completion without its token ids "
                   "(the rag_spec.token_ids field of its last chunk, which rag-spec serve "
                   "sends): iterative RaLM continues prefixes token for token, which text alone "
                   "cannot give. Serve the model with `rag-spec serve`.")
            raise RagSpecError(msg)
        return Continuation([int(t) for t in final["token_ids"]], reason,
                            int(usage.get("prompt_tokens", len(token_ids))),
                            int((usage.get("prompt_tokens_details") or {}).get(
                                "cached_tokens") or 0))

    def reset_prefix_cache(self) -> bool:
        """Ask the server to drop its cached prompt prefixes (``POST /reset_prefix_cache``,
        as vLLM's and ``rag-spec serve`` have it), so that what follows is measured from a
        cold cache; False where the server has no such route."""
        try:
            with self._open("/reset_prefix_cache", {}) as response:
                response.read()
        except _Refused as err:
            if err.status in (404, 405):
                return False
            raise
        return True

    def _events(self, path: str, body: dict[str, Any], cancel: Cancel | None = None
                ) -> Iterator[dict[str, Any]]:
        """The chunks of a greedy answer to ``body``, streamed from ``path`` as server-sent
        events (data lines; comment lines are a server's keep-alive pings). Once ``cancel`` is
        set the connection is shut, and ``_Cancelled`` raised."""
        body = {**body, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        ended = False  # the stream's last line, "data: [DONE]", came
        try:
            with self._open(path, body, cancel) as response:
                for line in response:
                    text = line.decode().strip()
                    if not text.startswith("data:"):
                        continue  # the blank line between events, or a comment (a ping)
                    payload = text.removeprefix("data:").strip()
                    if payload == "[DONE]":
                        ended = True
                    else:
                        yield json.loads(payload)
        except RagSpecError:
            if cancel is not None and cancel.is_set():
                raise _Cancelled from None
            raise
        if cancel is not None and cancel.is_set():  # shut mid-stream: what came is not whole
            raise _Cancelled
        if not ended:
            msg = (f"The server at {self.base_url} closed the stream from {path} before its "
                   "end (no [DONE]): the answer is incomplete.")
            raise RagSpecError(msg)

    @contextlib.contextmanager
    def _open(self, path: str, body: dict[str, Any], cancel: Cancel | None = None
              ) -> Iterator[http.client.HTTPResponse]:
        """The server's response to ``body`` posted at ``path``; errors name the server.
        ``cancel``, once set, shuts the connection (a blocked read then ends)."""
        url = urllib.parse.urlsplit(self.base_url + path)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = kind(url.hostname or "127.0.0.1", url.port, timeout=self.timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"

        def shut() -> None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

        try:
            connection.connect()
            # the socket itself: a response that closes the connection at its end takes it over
            # from ``connection`` (whose ``sock`` is then None) while its body is read
            sock = connection.sock
            with cancel.hooked(shut) if cancel is not None else contextlib.nullcontext():
                connection.request("POST", url.path, json.dumps(body).encode(), headers)
                response = connection.getresponse()
                if response.status >= 400:
                    detail = response.read().decode(errors="replace")[:300]
                    msg = (f"The server at {self.base_url} refused a request to {path} "
                           f"({response.status}): {detail}")
                    raise _Refused(msg, response.status)
                yield response
        except (OSError, http.client.HTTPException) as err:
            msg = (f"Could not reach the server at {self.base_url} ({err}); start it (`rag-spec "
                   "serve`) or check the address.")
            raise RagSpecError(msg) from err
        finally:
            connection.close()


class _Refused(RagSpecError):
    """The server answered with an error status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class _Cancelled(Exception):
    """A streamed answer cut short by its ``Cancel``."""


def _tokenizer(tokenizer: Any) -> Any:
    if tokenizer is not None and not isinstance(tokenizer, str):
        return tokenizer
    from transformers import AutoTokenizer

    if tokenizer is None:
        from rag_spec.models.embedded import pull
        from rag_spec.models.registry import DEFAULT_MODEL

        tokenizer = str(pull(DEFAULT_MODEL))
    return AutoTokenizer.from_pretrained(tokenizer)


class ServedState(SegmentHistory):
    """Output so far and the segments that produced it, for one request to a served model
    (``RalmState``'s interface; the server holds the caches)."""

    def __init__(self, served: ServedModel, build_prompt: Callable[[Sequence[Hit]], list[int]],
                 eos_ids: Sequence[int]) -> None:
        super().__init__(build_prompt, eos_ids)
        self.served = served
        self.prompt_tokens = 0  # prompt tokens the server was sent, all strides
        self.cached_tokens = 0  # of them, read from the server's prefix cache (as it says)
        self.cancelled_strides = 0  # closed mid-stream: a wrong guess behind them was found
        self._ended = False  # the server ended the answer without an end token in the ids

    @property
    def finished(self) -> bool:
        return self._ended or super().finished

    def use(self, passages: list[Hit], point: int) -> None:
        """Continue under ``passages`` (a new prompt from the next stride on)."""
        if not self.unchanged(passages):
            self.segments.append(Segment(passages, point, self.build_prompt(passages), None))

    def step(self, n: int, cancel: Cancel | None = None) -> int:
        """Up to ``n`` greedy tokens from the server (none once ``cancel`` is set: the stride
        is dropped); returns how many were added."""
        if n < 1 or self.finished:
            return 0
        started = time.perf_counter()
        done = self.served.complete(self.segments[-1].prompt + self.output, n, cancel)
        self.compute_seconds += time.perf_counter() - started
        if done.finish_reason == "cancelled":
            self.cancelled_strides += 1
            return 0
        self.prompt_tokens += done.prompt_tokens
        self.cached_tokens += done.cached_tokens
        self.output.extend(done.token_ids)
        self._ended = done.finish_reason == "stop" and len(done.token_ids) < n
        return len(done.token_ids)

    def rollback(self, point: int, length: int) -> None:
        """Return to retrieval ``point``, where the output had ``length`` tokens."""
        self.drop_after(point, length)
        self._ended = False
