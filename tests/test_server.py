"""``rag-spec serve``: the OpenAI API over LocalLM, on 127.0.0.1 only, started and stopped by
each test. Clients unchanged (the ``openai`` SDK, LangChain's ``ChatOpenAI``, LlamaIndex's
``OpenAILike``): greedy answers equal the in-process classes' with the same settings; bad
input is a 4xx with the API's error body and a sentence, never a traceback."""

import json
import threading
from contextlib import contextmanager

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from langchain_rag_spec import ChatLookahead, LookaheadLLM  # noqa: E402
from rag_spec import Server, create_app  # noqa: E402

MAX = 16


@contextmanager
def running(app):
    """``app`` served on a free loopback port for the block; stopped after it."""
    with Server(app=app) as server:
        yield server.url
    assert not server._thread.is_alive()


@pytest.fixture(scope="module")
def app(tiny_model_dir):
    return create_app(tiny_model_dir, background=False)


@pytest.fixture(scope="module")
def url(app):
    with running(app) as address:
        yield address


@pytest.fixture
def client(url):
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_models_health_and_a_chat_answer_equal_to_chat_lookahead(client, url, tiny_model_dir):
    assert [m.id for m in client.models.list()] == [tiny_model_dir]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    reply = client.chat.completions.create(
        model=tiny_model_dir, messages=[{"role": "user", "content": "hello there"}],
        max_tokens=MAX, temperature=0)
    expected = ChatLookahead(model=tiny_model_dir, max_tokens=MAX).invoke("hello there")
    assert reply.choices[0].message.content == expected.content
    assert reply.choices[0].finish_reason == expected.response_metadata["finish_reason"]
    assert reply.usage.completion_tokens == expected.usage_metadata["output_tokens"]
    assert reply.model_extra["rag_spec"]["tokens_per_step"] >= 1  # speculation's stats


def test_a_streamed_answer_joins_to_the_answer_and_ends_with_usage(client, tiny_model_dir):
    messages = [{"role": "user", "content": "the cat sat"}]
    whole = client.chat.completions.create(model=tiny_model_dir, messages=messages,
                                           max_tokens=MAX, temperature=0)
    chunks = list(client.chat.completions.create(
        model=tiny_model_dir, messages=messages, max_tokens=MAX, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_text_completions_equal_the_llm_class(client, tiny_model_dir):
    prompt = "the cat sat on the mat. the cat"
    done = client.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=MAX,
                                     temperature=0)
    assert done.choices[0].text == LookaheadLLM(model=tiny_model_dir,
                                                max_tokens=MAX).invoke(prompt)
    streamed = client.completions.create(model=tiny_model_dir, prompt=prompt, max_tokens=MAX,
                                         temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == done.choices[0].text


def test_langchain_and_llamaindex_openai_clients_work_unchanged(url, tiny_model_dir):
    from langchain_openai import ChatOpenAI
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    expected = ChatLookahead(model=tiny_model_dir, max_tokens=MAX).invoke("hello there").content
    chat = ChatOpenAI(base_url=f"{url}/v1", api_key="unused", model=tiny_model_dir,
                      max_tokens=MAX, temperature=0)
    assert chat.invoke("hello there").content == expected
    assert "".join(c.content for c in chat.stream("hello there")) == expected
    assert [m.content for m in chat.batch(["hello there", "hello there"])] == [expected] * 2
    index = OpenAILike(api_base=f"{url}/v1", api_key="unused", model=tiny_model_dir,
                       max_tokens=MAX, temperature=0, is_chat_model=True)
    assert index.chat([ChatMessage(role="user", content="hello there")]).message.content == \
        expected


@pytest.mark.parametrize("body, status, words", [
    ("{not json", 400, "not valid JSON"),
    ({"messages": [{"role": "user", "content": "hi"}], "frobnicate": 1}, 400,
     "Unknown field 'frobnicate'"),
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, 400, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "use system, developer"),
    ({"messages": [{"role": "user", "content": "hi"}], "model": "gpt-9"}, 404,
     "not served here"),
    ({"messages": [{"role": "user", "content": "x" * 400}]}, 400, "context window"),
    ({"messages": [{"role": "user", "content": "hi"}],
      "response_format": {"type": "yaml"}}, 400, "json_schema"),
])
def test_bad_requests_get_the_apis_error_body_and_a_sentence(url, body, status, words):
    sent = body if isinstance(body, str) else json.dumps(body)
    answer = httpx.post(f"{url}/v1/chat/completions", content=sent,
                        headers={"content-type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert words in error["message"] and error["type"]
    assert "Traceback" not in answer.text


def test_a_key_guards_every_route_but_health(tiny_model_dir):
    with running(create_app(tiny_model_dir, api_key="s3cret", background=False)) as address:
        assert httpx.get(f"{address}/health").status_code == 200
        assert httpx.get(f"{address}/v1/models").status_code == 401
        wrong = httpx.get(f"{address}/v1/models", headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401 and "Bearer" in wrong.json()["error"]["message"]
        ok = httpx.get(f"{address}/v1/models", headers={"authorization": "Bearer s3cret"})
        assert ok.status_code == 200


def test_not_ready_is_503_and_past_the_cap_is_429(tiny_model_dir, monkeypatch):
    from rag_spec.serving import server

    release = threading.Event()
    load = server._State.load
    monkeypatch.setattr(server._State, "load", lambda self, kw: (release.wait(30),
                                                                 load(self, kw)))
    app = create_app(tiny_model_dir, max_waiting=1)
    with running(app) as address:
        loading = httpx.get(f"{address}/v1/models")
        assert loading.status_code == 503 and loading.headers["retry-after"]
        assert httpx.get(f"{address}/health").json()["status"] == "loading"
        release.set()
        app.state.rag_spec.ready.wait(30)
        app.state.rag_spec.in_flight = 1  # one request in flight already: the cap
        busy = httpx.post(f"{address}/v1/completions", json={"prompt": "the cat"})
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        app.state.rag_spec.in_flight = 0
        assert httpx.post(f"{address}/v1/completions",
                          json={"prompt": "the cat", "max_tokens": 4}).status_code == 200


def test_the_row_cap_reaches_the_batch(tiny_model_dir):
    app = create_app(tiny_model_dir, max_rows=3, background=False)
    assert app.state.rag_spec.lm._scheduler.max_rows == 3


def test_a_client_that_drops_a_stream_frees_the_model(client, url, tiny_model_dir):
    with httpx.stream("POST", f"{url}/v1/chat/completions", json={
            "model": tiny_model_dir, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 200, "stream": True}) as stream:
        next(stream.iter_lines())  # the first event, then hang up
    reply = client.chat.completions.create(  # the next request is answered
        model=tiny_model_dir, messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert reply.choices[0].message.content is not None


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather at a location.",
    "parameters": {"type": "object", "required": ["location"],
                   "properties": {"location": {"type": "string", "maxLength": 30}}}}}


@pytest.mark.e2e
@pytest.mark.usefixtures("user_cache")
def test_tools_json_and_embeddings_on_the_embedded_model():
    """A forced call parses into the API's tool_calls, as ChatLookahead's own call; JSON under
    a schema parses; embeddings are the knowledge bases' MiniLM vectors; ChatOpenAI's
    ``bind_tools`` and ``with_structured_output`` give what ChatLookahead's give."""
    from rag_spec import Embedder

    with running(create_app(background=False)) as address:
        client = openai.OpenAI(base_url=f"{address}/v1", api_key="unused", max_retries=0)
        question = [{"role": "user", "content": "What is the weather in Paris?"}]
        reply = client.chat.completions.create(
            model="smollm2-135m-instruct", messages=question, tools=[WEATHER],
            tool_choice="required", max_tokens=64, temperature=0)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls"
        ours = ChatLookahead(max_tokens=64).bind_tools([WEATHER], tool_choice="any").invoke(
            "What is the weather in Paris?")
        assert (call.function.name, json.loads(call.function.arguments)) == \
            (ours.tool_calls[0]["name"], ours.tool_calls[0]["args"])
        streamed = [c for c in client.chat.completions.create(
            model="smollm2-135m-instruct", messages=question, tools=[WEATHER],
            tool_choice="required", max_tokens=64, temperature=0, stream=True) if c.choices]
        calls = [t for c in streamed for t in (c.choices[0].delta.tool_calls or [])]
        assert [(t.function.name, t.function.arguments) for t in calls] == \
            [(call.function.name, call.function.arguments)]
        schema = {"type": "object", "required": ["ok", "n"],
                  "properties": {"ok": {"type": "boolean"},
                                 "n": {"type": "integer", "minimum": 0, "maximum": 9}}}
        answer = client.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=48, temperature=0,
            messages=[{"role": "user", "content": "Is 3 odd? Answer as JSON."}],
            response_format={"type": "json_schema",
                             "json_schema": {"name": "answer", "schema": schema}})
        parsed = json.loads(answer.choices[0].message.content)
        assert set(parsed) == {"ok", "n"} and isinstance(parsed["ok"], bool)
        vectors = client.embeddings.create(model="all-MiniLM-L6-v2", input=["join paths", "x"])
        expected = Embedder.default().encode(["join paths", "x"])
        assert [len(d.embedding) for d in vectors.data] == [384, 384]
        assert max(abs(a - b) for d, e in zip(vectors.data, expected)
                   for a, b in zip(d.embedding, e)) < 1e-5
        from langchain_openai import ChatOpenAI
        from pydantic import BaseModel, Field

        class Flags(BaseModel):
            """Whether it holds, and a digit."""

            ok: bool
            n: int = Field(ge=0, le=9)

        remote = ChatOpenAI(base_url=f"{address}/v1", api_key="unused", temperature=0,
                            model="smollm2-135m-instruct", max_tokens=64)
        local = ChatLookahead(max_tokens=64)
        asked = "What is the weather in Paris?"
        calls = [llm.bind_tools([WEATHER], tool_choice="any").invoke(asked).tool_calls
                 for llm in (remote, local)]
        assert [[(c["name"], c["args"]) for c in made] for made in calls] == \
            [[(c["name"], c["args"]) for c in calls[1]]] * 2
        assert remote.with_structured_output(Flags).invoke("Is 3 odd? n is 3.") == \
            local.with_structured_output(Flags).invoke("Is 3 odd? n is 3.")


SOAK_BOUND_MB = 200  # the server's RSS growth over 200 requests, after a warm-up round at
# full concurrency, measured once the server is idle


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.usefixtures("user_cache")
def test_a_soak_of_200_mixed_requests_from_16_clients():
    """Streamed and not, tools, JSON schemas, bad requests and dropped streams, 16 clients at
    once: every valid request answered, every bad one a 4xx with a sentence, memory growth
    bounded, and the server still answering."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    from rag_spec.bench.report import rss_mb
    from rag_spec.serving.scheduler import _return_free_memory

    chat = "/v1/chat/completions"
    ask = [{"role": "user", "content": "What does os.path.join do?"}]
    valid = [
        (chat, {"messages": ask, "max_tokens": 8}),
        (chat, {"messages": ask, "max_tokens": 8, "stream": True}),
        (chat, {"messages": ask, "max_tokens": 8, "temperature": 0.7, "seed": 3}),
        ("/v1/completions", {"prompt": "import os\n", "max_tokens": 8}),
        (chat, {"messages": ask, "max_tokens": 48, "tools": [WEATHER],
                "tool_choice": "required"}),
        (chat, {"messages": ask, "max_tokens": 32, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {
                "type": "object", "required": ["ok"],
                "properties": {"ok": {"type": "boolean"}}}}}}),
    ]
    bad = [(chat, {"messages": ask, "top_p": 7}), (chat, {"messages": []}),
           ("/v1/completions", {"prompt": 3}), (chat, {"messages": ask, "nope": True})]
    kinds = [*(("valid", r) for r in valid), *(("bad", r) for r in bad), ("drop", valid[1])]
    with Server() as server:
        def send(item):
            kind, (route, body) = item
            if kind == "drop":  # a client that hangs up mid-stream
                with httpx.stream("POST", server.url + route, json=body, timeout=120) as s:
                    next(s.iter_lines())
                return kind, 200, ""
            answer = httpx.post(server.url + route, json=body, timeout=300)
            return kind, answer.status_code, answer.text

        def settled_rss():
            """RSS once the server is idle (a last request answered: dropped streams' rows
            have ended) and has given back what it freed, as it does when it goes idle."""
            assert httpx.post(server.url + chat, json=valid[0][1], timeout=60).status_code == 200
            gc.collect()
            _return_free_memory()
            return rss_mb()

        with ThreadPoolExecutor(16) as pool:
            # warm-up at full concurrency: grammars compiled, kernels loaded, and the batch
            # in flight at every size it takes (each row count's step costs and shapes)
            list(pool.map(send, kinds * 4))
            before = settled_rss()
            results = list(pool.map(send, [kinds[i % len(kinds)] for i in range(200)]))
        grown = settled_rss() - before
        for kind, status, text in results:
            if kind == "valid":
                assert status == 200, text
            elif kind == "bad":
                assert 400 <= status < 500 and json.loads(text)["error"]["message"], text
        assert grown < SOAK_BOUND_MB, f"RSS grew {grown:.0f} MB over 200 requests"
        assert httpx.post(server.url + chat, json=valid[0][1], timeout=60).status_code == 200


@pytest.mark.slow  # a process of its own
def test_the_command_serves_and_sigterm_finishes_the_request_in_flight(tiny_model_dir):
    """``rag-spec serve`` on loopback: a request in flight when SIGTERM comes is answered
    whole, then the process exits without a traceback."""
    import os
    import signal
    import socket
    import subprocess
    import sys
    with socket.socket() as probe:  # a free port on loopback
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "rag_spec.cli", "serve", "--model", tiny_model_dir,
               "--port", str(port)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        while True:  # until it listens and the model is loaded
            assert process.poll() is None, process.stderr.read()
            try:
                if httpx.get(f"{url}/health", timeout=5).json()["status"] == "ok":
                    break
            except httpx.TransportError:
                pass
            threading.Event().wait(0.2)
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "prompt": "the cat", "max_tokens": 200, "temperature": 0,
                "stream": True}) as stream:
            lines = stream.iter_lines()
            first = next(line for line in lines if line)  # in flight now
            process.send_signal(signal.SIGTERM)
            rest = [line for line in lines if line]
        assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
        # uvicorn drains, then re-raises the signal it caught: the exit status says SIGTERM
        assert process.wait(timeout=60) in (0, -signal.SIGTERM)
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()

