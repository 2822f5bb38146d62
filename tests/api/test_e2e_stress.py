"""Load and shutdown on CPU with the real engine: many concurrent streams, mass disconnects, SIGTERM."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest
import trio

from candle_vllm.api.state import ServerConfig
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind
from tests.api.test_e2e_openai import real_engine_cm


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with running(real_engine_cm(), ServerConfig(), tcp_bind()) as srv:
        yield srv


async def _stream_text(client: httpx.AsyncClient, body: dict) -> tuple[str, list[str]]:
    """Concatenated completion text and the finish reasons seen, checking the stream ends with [DONE]."""
    import json

    text, finishes, done = "", [], False
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            choice = json.loads(data)["choices"][0]
            text += choice["text"]
            if choice["finish_reason"]:
                finishes.append(choice["finish_reason"])
    assert done
    return text, finishes


def _client(srv: ServerThread) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(base_url=srv.urls[0], timeout=600, limits=limits)


@pytest.mark.slow
def test_256_concurrent_streams_match_sequential(server: ServerThread) -> None:
    prompts = [f"Item {i}: the colour of the sky is" for i in range(256)]

    async def concurrent() -> list[tuple[str, list[str]]]:
        results: list[tuple[str, list[str]]] = [("", [])] * len(prompts)
        async with _client(server) as client, trio.open_nursery() as nursery:
            async def one(i: int) -> None:
                results[i] = await _stream_text(client, {"prompt": prompts[i], "max_tokens": 8, "temperature": 0})

            for i in range(len(prompts)):
                nursery.start_soon(one, i)
        return results

    got = trio.run(concurrent)
    assert all(f == ["length"] for _, f in got)
    with server.http() as http:
        for i in range(len(prompts)):  # one request at a time: each runs alone in the engine
            want = http.post("/v1/completions", json={"prompt": prompts[i], "max_tokens": 8,
                                                      "temperature": 0}).json()["choices"][0]["text"]
            assert got[i][0] == want, i


@pytest.mark.slow
def test_1000_disconnects_leave_nothing_behind(server: ServerThread) -> None:
    async def main() -> None:
        async with _client(server) as client:
            async def one(i: int) -> None:
                async with client.stream("POST", "/v1/completions", json={
                        "prompt": f"Story {i}:", "max_tokens": 2000, "stream": True, "ignore_eos": True}) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data: "):
                            return  # leave after the first chunk: the connection is closed mid-stream

            for batch in range(10):
                async with trio.open_nursery() as nursery:
                    for i in range(100):
                        nursery.start_soon(one, batch * 100 + i)

    trio.run(main)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = server.metrics()
        if m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0:
            break
        time.sleep(0.2)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0
    assert m["vllm:kv_cache_usage_perc"] == 0
    assert m['vllm:request_success_total{finished_reason="abort"}'] >= 1000
    r = server.openai().completions.create(model=server.openai().models.list().data[0].id, prompt="Hello",
                                           max_tokens=3)
    assert r.choices[0].finish_reason == "length"


@pytest.mark.slow
def test_sigterm_during_32_streams_ends_each_and_exits_fast(tmp_path) -> None:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "candle_vllm", "--m", str(smollm2_path()), "--h", "127.0.0.1",
                             "--p", "0", "--mem", "256", "--max-num-seqs", "32"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = None
        lines = []
        while url is None:
            line = proc.stdout.readline()
            assert line, "server exited early:\n" + "".join(lines)
            lines.append(line)
            found = re.search(r"API: (http://127\.0\.0\.1:\d+)/v1", line)
            url = found.group(1) if found else None
        results: list[tuple[str, list[str]]] = []

        async def main() -> float:
            async with httpx.AsyncClient(base_url=url, timeout=60) as client, trio.open_nursery() as nursery:
                async def one(i: int) -> None:
                    results.append(await _stream_text(client, {"prompt": f"Essay {i}:", "max_tokens": 4000,
                                                               "ignore_eos": True}))

                for i in range(32):
                    nursery.start_soon(one, i)
                await trio.sleep(3)  # every stream is generating by now
                start = trio.current_time()
                proc.send_signal(signal.SIGTERM)
                while proc.poll() is None:
                    await trio.sleep(0.05)
                return trio.current_time() - start

        took = trio.run(main)
        assert proc.returncode == 0
        assert took < 5
        assert len(results) == 32
        assert all(finishes == ["abort"] for _, finishes in results)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
