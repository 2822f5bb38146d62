"""Connection lifecycle through the real HTTP stack: keep-alives, client disconnects, draining shutdown, unix
sockets (fake engine, so timings are controlled)."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from candle_vllm.api.state import ServerConfig
from tests.api.conftest import ServerThread, engine_cm, running, tcp_bind, unix_bind
from tests.api.fake_engine import FakeEngine

MESSAGES = [{"role": "user", "content": "hi"}]


def test_idle_stream_sends_keepalive_comments(smol_tokenizer) -> None:
    engine = FakeEngine(smol_tokenizer, delay_s=0.35)
    with running(engine_cm(engine), ServerConfig(keepalive_s=0.1), tcp_bind()) as srv, srv.http() as http:
        raw = http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True, "max_tokens": 3}).text
        assert ": ping\n\n" in raw and raw.endswith("data: [DONE]\n\n")
        # the SDK skips the comments
        parts = srv.openai().chat.completions.create(model="fake-model", messages=MESSAGES, stream=True,
                                                     max_tokens=3)
        assert sum(1 for c in parts if c.choices and c.choices[0].finish_reason) == 1


def test_client_disconnect_aborts_engine_request(smol_tokenizer) -> None:
    engine = FakeEngine(smol_tokenizer, delay_s=0.05)
    with running(engine_cm(engine), ServerConfig(), tcp_bind()) as srv:
        for _ in range(5):
            with srv.http() as http, http.stream("POST", "/v1/completions",
                                                 json={"prompt": "a", "stream": True, "max_tokens": 500}) as resp:
                lines = resp.iter_lines()
                assert next(lines).startswith("data: ")
        for path, body in (("/v1/completions", {"prompt": "b", "max_tokens": 400}),
                           ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 400})):
            with pytest.raises(httpx2.ReadTimeout), srv.http(timeout=0.3) as http:  # non-streaming clients too
                http.post(path, json=body)
        deadline = time.monotonic() + 5
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert engine.running == set() and len(engine.aborted) == 7
        metrics = srv.metrics()
        assert metrics["vllm:num_requests_running"] == 0 and metrics["vllm:kv_cache_usage_perc"] == 0
        assert metrics['vllm:request_success_total{finished_reason="abort"}'] == 7
        assert srv.openai().completions.create(model="fake-model", prompt="c", max_tokens=2).choices


def _stream_in_thread(srv, results: list[str], body: dict) -> threading.Thread:
    def run() -> None:
        with srv.http() as http:
            results.append(http.post("/v1/chat/completions", json=body).text)

    t = threading.Thread(target=run)
    t.start()
    return t


@pytest.mark.parametrize("finish_in_grace", [True, False])
def test_drain_finishes_or_aborts_streams(smol_tokenizer, finish_in_grace: bool) -> None:
    engine = FakeEngine(smol_tokenizer, delay_s=0.05, max_model_len=20_000)
    results: list[str] = []
    srv = ServerThread(engine_cm(engine), ServerConfig(shutdown_timeout_s=1.0), tcp_bind()).start()
    max_tokens = 10 if finish_in_grace else 10_000  # 0.5 s of tokens, or far more than the grace period
    threads = [_stream_in_thread(srv, results, {"messages": MESSAGES, "stream": True, "max_tokens": max_tokens,
                                                "n": 2}) for _ in range(8)]
    while len(engine.running) < 8 and len(results) < 8:
        time.sleep(0.01)
    took = srv.stop()
    for t in threads:
        t.join(5)
    assert took < 5 and not srv.is_alive
    assert len(results) == 8
    want = "length" if finish_in_grace else "abort"
    for raw in results:
        assert raw.endswith("data: [DONE]\n\n")
        assert raw.count(f'"finish_reason":"{want}"') == 2  # both choices finish, once each
    assert engine.running == set()


def test_draining_refuses_new_requests(smol_tokenizer) -> None:
    engine = FakeEngine(smol_tokenizer, delay_s=0.05)
    srv = ServerThread(engine_cm(engine), ServerConfig(shutdown_timeout_s=2.0), tcp_bind()).start()
    results: list[str] = []
    t = _stream_in_thread(srv, results, {"messages": MESSAGES, "stream": True, "max_tokens": 30})
    while not engine.running:
        time.sleep(0.01)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    time.sleep(0.2)
    with srv.http() as http:
        health = http.get("/health")
        refused = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert health.status_code == 503
    assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
    assert "Retry-After" in refused.headers
    stopper.join(5)
    t.join(5)
    assert results[0].count('"finish_reason":"length"') == 1


def test_unix_socket_is_private_and_removed(smol_tokenizer, tmp_path: Path) -> None:
    engine = FakeEngine(smol_tokenizer)
    binds = unix_bind(tmp_path)
    with running(engine_cm(engine), ServerConfig(), binds) as srv:
        mode = stat.S_IMODE(os.stat(binds[0].address).st_mode)
        assert stat.S_ISSOCK(os.stat(binds[0].address).st_mode) and mode == 0o600
        assert srv.urls == [f"http://unix:{binds[0].address}"]
        r = srv.openai().chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=3)
        assert r.choices[0].finish_reason == "length"
        with srv.http() as http:
            assert http.get("/version").status_code == 200
    assert not os.path.exists(binds[0].address)


@pytest.mark.parametrize("finish_in_grace", [True, False])
def test_drain_waits_for_a_whole_beam_search(smol_tokenizer, finish_in_grace: bool) -> None:
    """A beam search is one request in flight: the drain lets all its steps run within the grace period (its
    choices come back), and past it ends the search with a 503 to retry elsewhere, never a half-searched 200."""
    engine = FakeEngine(smol_tokenizer, delay_s=0.02, max_model_len=20_000)
    srv = ServerThread(engine_cm(engine), ServerConfig(shutdown_timeout_s=1.5), tcp_bind()).start()
    max_tokens = 8 if finish_in_grace else 500  # 8 steps of 0.02 s, or far past the grace period
    replies: list[Any] = []

    def search() -> None:
        with srv.http() as http:
            replies.append(http.post("/v1/completions", json={"prompt": "the cat", "max_tokens": max_tokens, "n": 2,
                                                               "use_beam_search": True}))

    t = threading.Thread(target=search)
    t.start()
    while not engine.running:
        time.sleep(0.005)
    took = srv.stop()
    t.join(5)
    assert took < 5 and not srv.is_alive and engine.running == set()
    [reply] = replies
    if finish_in_grace:
        assert reply.status_code == 200 and len(reply.json()["choices"]) == 2, reply.text
        assert all(c["finish_reason"] == "length" for c in reply.json()["choices"])
    else:
        assert reply.status_code == 503 and "beam search was stopped" in reply.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_response_the_drain_ends_is_failed_not_completed(smol_tokenizer, stream: bool) -> None:
    """/v1/responses cut by the drain: status ``failed`` with a server_error (a stream ends with
    ``response.failed``), never a ``completed`` answer of cut text."""
    engine = FakeEngine(smol_tokenizer, delay_s=0.05, max_model_len=20_000)
    srv = ServerThread(engine_cm(engine), ServerConfig(shutdown_timeout_s=0.3), tcp_bind()).start()
    replies: list[Any] = []

    def ask() -> None:
        with srv.http() as http:
            replies.append(http.post("/v1/responses", json={"input": "the cat", "max_output_tokens": 10_000,
                                                             "stream": stream}))

    t = threading.Thread(target=ask)
    t.start()
    while not engine.running:
        time.sleep(0.005)
    srv.stop()
    t.join(5)
    [reply] = replies
    if stream:
        last = [line for line in reply.text.splitlines() if line.startswith("data: ")][-1]
        final = json.loads(last.removeprefix("data: "))
        assert final["type"] == "response.failed"
        body = final["response"]
    else:
        body = reply.json()
    assert body["status"] == "failed" and body["error"]["code"] == "server_error"
    assert body["output"][0]["status"] == "incomplete"
