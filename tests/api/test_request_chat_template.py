"""Templates sent with requests and prompt preparation off the event loop, against the real server running the
embedded SmolLM2: a request's ``chat_template`` is Jinja run on the server, refused unless the server trusts
them (``--trust-request-chat-template``, vLLM's rule); when trusted, a slow render, like tokenizing a huge
prompt, must not stall the other requests (``/health`` here)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx2
import openai
import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind

MESSAGES = [{"role": "user", "content": "Hi"}]
# 4e8 empty loop turns: over 10 s of rendering on the machine this was written on, ending in the prompt "hi".
SLOW_TEMPLATE = "{% for i in range(20000) %}{% for j in range(20000) %}{% endfor %}{% endfor %}hi"


def smollm2_server(trust: bool) -> Any:
    args = EngineArgs(model=str(smollm2_path()), mem=64, max_num_seqs=8)
    return running(lambda: open_engine(args), ServerConfig(trust_request_chat_template=trust), tcp_bind())


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with smollm2_server(trust=False) as srv:
        yield srv


@pytest.mark.parametrize(("extra", "param"), [
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
    ({"chat_template_kwargs": {"chat_template": "{{ messages[0].content }}"}}, "chat_template_kwargs"),
    ({"chat_template": "x", "chat_template_kwargs": {"chat_template": "x", "enable_thinking": False}},
     "chat_template"),
])
def test_request_templates_are_refused_without_the_flag(server: ServerThread, extra: dict[str, Any],
                                                        param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(model=server.engine.model_name, messages=MESSAGES, max_tokens=2,
                                                extra_body=extra)
    err = info.value.body
    assert (err["param"], err["type"]) == (param, "invalid_request_error")
    assert "--trust-request-chat-template" in err["message"]
    with server.http() as http:
        r = http.post("/tokenize", json={"messages": MESSAGES, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_the_models_own_template_may_be_named(server: ServerThread) -> None:
    tokenizer = server.engine.tokenizer
    expected = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    with server.http() as http:
        r = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": "default"})
    assert r.status_code == 200 and r.json()["tokens"] == expected


def _health_while(server: ServerThread, send: Callable[[httpx2.Client], httpx2.Response],
                  started_after_s: float) -> tuple[float, bool, float, httpx2.Response]:
    """Send a slow request in a thread; after ``started_after_s``, time ``GET /health``. Returns the health
    latency, whether the slow request was still running when health answered, its duration and response."""
    result: dict[str, Any] = {}

    def slow() -> None:
        start = time.monotonic()
        with server.http(timeout=300) as http:
            result["response"] = send(http)
        result["elapsed"] = time.monotonic() - start

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(started_after_s)
    with server.http() as http:
        start = time.monotonic()
        assert http.get("/health").status_code == 200
        health_s = time.monotonic() - start
    running_then = thread.is_alive()
    thread.join(300)
    return health_s, running_then, result["elapsed"], result["response"]


def test_a_slow_trusted_template_does_not_stall_the_server() -> None:
    with smollm2_server(trust=True) as srv:
        def chat(http: httpx2.Client) -> httpx2.Response:
            return http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2,
                                                            "chat_template": SLOW_TEMPLATE})

        health_s, running_then, elapsed, response = _health_while(srv, chat, started_after_s=1.0)
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == len(srv.engine.tokenizer.encode("hi",
                                                                                         add_special_tokens=False))
        assert elapsed > 5.0, "the template rendered too fast to show anything"
        assert running_then and health_s < 2.0, (health_s, elapsed)


def test_tokenizing_a_huge_prompt_does_not_stall_the_server(server: ServerThread) -> None:
    prompt = "hello world, " * 600_000  # 7.8 MB, 1.8M tokens: seconds of tokenizing

    def tokenize(http: httpx2.Client) -> httpx2.Response:
        return http.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False})

    health_s, running_then, elapsed, response = _health_while(server, tokenize, started_after_s=0.5)
    assert response.status_code == 200 and response.json()["count"] > 1_000_000
    assert running_then and health_s < 1.0, (health_s, elapsed)


def test_documents_reach_the_chat_template() -> None:
    """``documents`` (transformers' RAG variable; vLLM passes it through) are rendered by a template that reads
    them, in chat completions and /tokenize alike."""
    template = "{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}{{ messages[0].content }}"
    documents = [{"title": "Sea", "text": "salty water"}]
    with smollm2_server(trust=True) as srv, srv.http() as http:
        body = {"messages": MESSAGES, "chat_template": template, "documents": documents}
        tokens = http.post("/tokenize", json=body).json()["tokens"]
        assert srv.engine.tokenizer.decode(tokens) == "[Sea: salty water]Hi"
        reply = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
        assert reply.status_code == 200 and reply.json()["usage"]["prompt_tokens"] == len(tokens)
