"""Iterative RaLM on a served model: ``ServedModel`` against ``rag-spec serve`` on loopback
(started and stopped here). The speculative loop's tokens equal the naive loop's against the
same server, rollbacks included, and the in-process loop's on the same model."""

import json
import threading
import urllib.request

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import HashRetriever, char_lm  # noqa: E402
from rag_spec import (  # noqa: E402
    IterativeRaLM,
    RagSpecError,
    RaLMSpeculation,
    ServedModel,
    Server,
    SpecRetriever,
    create_app,
    load_model,
)
from rag_spec.bench.simulated import DelayedRetriever  # noqa: E402

QUESTION = "which word comes after alpha beta?"
SETTINGS = {"stride": 2, "query_tokens": 12}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny character Llama whose window takes prompts with passages, saved as a folder."""
    folder = tmp_path_factory.mktemp("served-llama")
    lm = char_lm(window=1024)
    lm.model.save_pretrained(folder)
    lm.tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def url(model_dir):
    with Server(app=create_app(model_dir, background=False)) as server:
        yield server.url


@pytest.fixture(scope="module")
def served(url, model_dir):
    return ServedModel(url, tokenizer=model_dir)


def test_the_served_naive_loop_equals_the_in_process_one(served, model_dir):
    kb = HashRetriever()
    local = IterativeRaLM(load_model(model_dir), kb, **SETTINGS).generate(QUESTION, 30)
    remote = IterativeRaLM(served, kb, **SETTINGS).generate(QUESTION, 30)
    assert remote.token_ids == local.token_ids
    assert remote.text == local.text
    assert remote.stats.kb_calls == local.stats.kb_calls
    assert remote.stats.generation_seconds > 0  # waiting on the server's strides
    # every stride re-sends its whole prompt: the server says how much it read
    assert remote.stats.served_prompt_tokens > len(remote.token_ids) * 10


@pytest.mark.parametrize("lying", [False, True])  # True: wrong guesses, rolled back
def test_speculative_retrieval_in_front_of_a_served_model_gives_the_naive_loops_tokens(
        served, lying):
    naive = IterativeRaLM(served, HashRetriever(), **SETTINGS).generate(QUESTION, 30)
    spec = IterativeRaLM(served, SpecRetriever(DelayedRetriever(HashRetriever(lying=lying), 3)),
                         speculation=RaLMSpeculation(os3=False, stride=3), **SETTINGS)
    result = spec.generate(QUESTION, 30)
    assert result.token_ids == naive.token_ids
    assert [h.doc_id for h in result.passages] == [h.doc_id for h in naive.passages]
    assert result.stats.speculation_hits + result.stats.rollbacks > 0  # it did speculate
    if lying:
        assert result.stats.rollbacks > 0


def test_a_servers_prefix_cache_reset_is_answered_where_nothing_is_stored(served):
    assert served.reset_prefix_cache()  # float32 weights: nothing stored, the route answers


def test_a_served_model_takes_no_lookahead_decoder_and_a_dead_server_is_named(served):
    from rag_spec import LookaheadDecoder

    lm = char_lm(window=1024)
    with pytest.raises(RagSpecError, match="decodes on the server"):
        IterativeRaLM(served, HashRetriever(), lookahead=LookaheadDecoder(lm.model,
                                                                          lm.tokenizer))
    gone = ServedModel("http://127.0.0.1:9", tokenizer=served.tokenizer, timeout=5)
    with pytest.raises(RagSpecError, match="Could not reach the server"):
        IterativeRaLM(gone, HashRetriever(), **SETTINGS).generate(QUESTION, 4)


def test_langchains_iterative_ralm_drives_a_served_model(served):
    from langchain_rag_spec import IterativeRaLM as ChainRaLM
    from langchain_rag_spec import SpecRetriever as ChainSpecRetriever

    expected = IterativeRaLM(served, HashRetriever(), **SETTINGS).generate(QUESTION, 30).text
    chain = ChainRaLM(served=served, retriever=ChainSpecRetriever(source=HashRetriever()),
                      max_tokens=30, **SETTINGS)
    assert chain.invoke(QUESTION) == expected
    with pytest.raises(ValueError, match="takes one model"):
        ChainRaLM(retriever=ChainSpecRetriever(source=HashRetriever()))


class Recording(ServedModel):
    """A served model that keeps each stride's prompt and the server's answer (a stride closed
    mid-stream has none)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def complete(self, token_ids, max_tokens, cancel=None):
        done = super().complete(token_ids, max_tokens, cancel)
        if done.finish_reason != "cancelled":
            self.seen.append((list(token_ids), done))
        return done


def post(url, body):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def shared_length(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.e2e
@pytest.mark.usefixtures("user_cache")
def test_a_served_stride_computes_only_what_follows_the_last_prompt_it_shares():
    """``rag-spec serve`` on the embedded model (GGUF weights: prompts read their stored
    prefixes): each stride, a rollback's included, computes at most the tokens after what it
    shares with the stride before (the server's ``cached_tokens``), and the answers stay the
    naive loop's."""
    with Server(app=create_app(background=False)) as server:
        served = Recording(server.url)
        settings = {"stride": 4, "query_tokens": 12}
        naive = IterativeRaLM(served, HashRetriever(), **settings).generate(QUESTION, 24)
        spec = IterativeRaLM(served, SpecRetriever(HashRetriever(lying=True)),
                             speculation=RaLMSpeculation(os3=False, stride=3), **settings)
        result = spec.generate(QUESTION, 24)
        last, _ = served.seen[-1]
        assert served.complete(last, 2).cached_tokens == len(last) - 1
        assert served.reset_prefix_cache()  # vLLM's route: a cold cache after it
        assert served.complete(last, 2).cached_tokens == 0
    served.seen = served.seen[:-2]
    assert result.token_ids == naive.token_ids and result.stats.rollbacks > 0
    for (before, _), (ids, done) in zip(served.seen, served.seen[1:]):
        assert done.prompt_tokens == len(ids)
        computed = done.prompt_tokens - done.cached_tokens
        # a prompt inside the one before still computes its last token (its logits)
        read = min(shared_length(before, ids), len(before) - 1, len(ids) - 1)
        assert computed <= len(ids) - read
    assert naive.stats.served_cached_tokens > 0 and result.stats.served_cached_tokens > 0


def test_one_shot_rag_on_a_served_model_streams_the_servers_answer(served, tmp_path, capsys):
    """``ask_served``: the passages retrieved here, the answer streamed from the chat route, as
    the server answers the same messages unstreamed; ``rag-spec ask --served`` prints it."""
    from rag_spec import rag_messages
    from rag_spec.cli import main
    from rag_spec.serving.ask import ask_served

    kb = HashRetriever()
    pieces = []
    answer = ask_served(served, kb, QUESTION, k=2, max_new_tokens=16, on_text=pieces.append)
    whole = post(served.base_url + "/v1/chat/completions", {
        "messages": rag_messages(QUESTION, answer.hits), "max_tokens": 16, "temperature": 0})
    assert len(pieces) > 1 and "".join(pieces) == answer.text
    assert answer.text == whole["choices"][0]["message"]["content"]
    assert answer.stats["completion_tokens"] == whole["usage"]["completion_tokens"]
    assert answer.stats["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    (tmp_path / "a.txt").write_text("alpha beta gamma delta and more words about files " * 3)
    assert main(["ask", QUESTION, "--served", served.base_url, "--source", str(tmp_path),
                 "--kind", "bm25", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "(bm25 index ready" in out and "Sources:" in out
    assert "tokens, " in out and f"s from {served.base_url}" in out


def _one_chunk_server(then):
    """A loopback server for one request: headers, one event, then ``then(handler)``."""
    import http.server
    import socketserver

    class OneChunk(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (http.server's name)
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n')
            self.wfile.flush()
            then(self)

        def log_message(self, *args):
            pass

    server = socketserver.TCPServer(("127.0.0.1", 0), OneChunk)
    threading.Thread(target=server.handle_request, daemon=True).start()
    return server


def test_a_stream_that_ends_before_done_is_an_error_not_an_answer():
    with _one_chunk_server(lambda handler: None) as server:  # closes after the one event
        served = ServedModel(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=object())
        with pytest.raises(RagSpecError, match="before its end"):
            served.complete([1, 2, 3], 8)


def test_a_cancelled_stride_closes_its_stream_and_returns_nothing():
    """Event order, no clock: a server that sends one chunk and then holds the stream open;
    setting the stride's ``Cancel`` ends the client's blocked read and shuts the connection
    (the server reads its end), and the stride comes back empty, "cancelled"."""
    from rag_spec.speculation import Cancel

    sent, closed = threading.Event(), threading.Event()

    def hold(handler):
        sent.set()
        if handler.rfile.read(1) == b"":  # the client shut its side
            closed.set()

    with _one_chunk_server(hold) as server:
        served = ServedModel(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=object())
        cancel, answers = Cancel(), []
        client = threading.Thread(target=lambda: answers.append(
            served.complete([1, 2, 3], 8, cancel)), daemon=True)
        client.start()
        assert sent.wait(30)
        cancel.set()
        client.join(30)
        assert closed.wait(30)
    assert answers and answers[0].finish_reason == "cancelled" and answers[0].token_ids == []
    assert served.complete([1, 2, 3], 8, cancel).finish_reason == "cancelled"  # set already
