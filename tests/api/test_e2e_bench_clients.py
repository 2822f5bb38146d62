"""End to end: the two serving benchmarks people point at an OpenAI-compatible server, against ours on the real
engine (embedded SmolLM2 GGUF).

``vllm bench serve`` needs the CUDA vllm wheel, so its client is reproduced here from
``vllm/benchmarks/lib/endpoint_request_func.py``: an aiohttp POST with ``stream: true``,
``stream_options.include_usage`` and ``ignore_eos``; SSE events split on a blank line; TTFT taken at the first
chunk whose ``choices`` is non-empty and ITL between such chunks; ``output_tokens`` from the final usage chunk.
If the server sent its role chunk before prefill, TTFT would be meaningless; if it ignored ``ignore_eos`` or
miscounted usage, every throughput figure would be wrong. guidellm 0.8.1 is too heavy for CI (torch +
transformers + a tokenizer directory), so only its request shape is reproduced: chat and completions bodies
with ``stream_options.continuous_usage_stats`` (usage on every chunk, as vLLM does) and ``ignore_eos``, read
line by line through httpx as its ``openai_http`` backend does, output tokens from the last usage seen.
"""

from __future__ import annotations

import asyncio
import codecs
import json
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx2
import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind

try:  # what vllm bench uses; httpx2 (a declared dependency) reads the same bytes where aiohttp is missing
    import aiohttp
except ImportError:  # pragma: no cover - depends on the environment
    aiohttp = None  # type: ignore[assignment]

OUTPUT_LEN = 16
# Greedy SmolLM2 ends these after 10 and 7 tokens, so only an honoured ``ignore_eos`` gives OUTPUT_LEN tokens.
EARLY_STOPPING_CHAT = ["Hi", "Name one colour."]
# Long enough that prefill takes measurably longer than a loopback round trip (the TTFT check needs that).
LONG_TEXT = " ".join(f"Item {i}: the sea is blue, the sky is grey, and the wind blows from the west."
                     for i in range(20))
COMPLETION_PROMPTS = ["The capital of France is Paris.", LONG_TEXT]
GREEDY = {"temperature": 0}  # ``vllm bench serve --temperature 0`` sends it in the request body (extra_body)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    """Our HTTP stack over TCP (both clients speak TCP) in front of the real engine."""
    args = EngineArgs(model=str(smollm2_path()), mem=256, max_num_seqs=8)
    with running(lambda: open_engine(args), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(server: ServerThread) -> str:
    """The model name both benchmarks take: ``data[0].id`` of ``/v1/models``, after ``/health`` answered."""
    with server.http() as http:
        health = http.get("/health")
        assert health.status_code == 200 and health.text == ""  # guidellm validates the backend with it
        return http.get("/v1/models").json()["data"][0]["id"]


# ---------------------------------------------------------------------------------------------------------------
# vllm bench serve's client (endpoint_request_func.py), reproduced


class StreamedResponseHandler:
    """vllm bench's SSE splitter: messages end at a blank line; a trailing ``data:`` message counts once its
    payload parses as JSON or is ``[DONE]`` (so a server that omits the final blank line still works)."""

    def __init__(self) -> None:
        self.buffer = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")()

    def add_chunk(self, chunk_bytes: bytes) -> list[str]:
        """Complete messages in the bytes received so far."""
        self.buffer += self._decoder.decode(chunk_bytes)
        messages = []
        while "\n\n" in self.buffer:
            message, self.buffer = self.buffer.split("\n\n", 1)
            if message := message.strip():
                messages.append(message)
        if self.buffer.startswith("data: "):
            content = self.buffer.removeprefix("data: ").strip()
            if content == "[DONE]":
                messages.append(self.buffer.strip())
                self.buffer = ""
            elif content:
                try:
                    json.loads(content)
                except json.JSONDecodeError:
                    pass
                else:
                    messages.append(self.buffer.strip())
                    self.buffer = ""
        return messages


@dataclass
class BenchOutput:
    """vllm bench's RequestFuncOutput, plus the raw chunks so the test can look at what set TTFT."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    output_tokens: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    error: str = ""
    token_chunks: list[dict[str, Any]] = field(default_factory=list)  # chunks with non-empty ``choices``
    usage_chunks: list[dict[str, Any]] = field(default_factory=list)


class BenchSession:
    """One HTTP session for a run, as vllm bench shares one ``aiohttp.ClientSession`` (keep-alive reuse)."""

    def __init__(self) -> None:
        self._aiohttp: Any = None
        self._httpx: httpx2.AsyncClient | None = None

    async def __aenter__(self) -> BenchSession:
        if aiohttp is not None:
            # vllm bench passes trust_env=True; off here so a CI proxy setting cannot capture loopback traffic
            self._aiohttp = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120), trust_env=False)
        else:  # pragma: no cover - depends on the environment
            self._httpx = httpx2.AsyncClient(timeout=120)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._aiohttp is not None:
            await self._aiohttp.close()
        if self._httpx is not None:  # pragma: no cover
            await self._httpx.aclose()

    def post(self, url: str, payload: dict[str, Any],
             headers: dict[str, str]) -> AbstractAsyncContextManager[tuple[int, str, AsyncIterator[bytes]]]:
        """(status, reason, body bytes as they arrive), like aiohttp's ``response.content.iter_any()``."""

        @asynccontextmanager
        async def cm() -> AsyncIterator[tuple[int, str, AsyncIterator[bytes]]]:
            if self._aiohttp is not None:
                async with self._aiohttp.post(url=url, json=payload, headers=headers) as resp:
                    yield resp.status, resp.reason or "", resp.content.iter_any()
            else:  # pragma: no cover
                assert self._httpx is not None
                async with self._httpx.stream("POST", url, json=payload, headers=headers) as resp:
                    yield resp.status_code, resp.reason_phrase, resp.aiter_raw()

        return cm()


def vllm_bench_payload(api_url: str, model: str, prompt: str, output_len: int) -> dict[str, Any]:
    """The body vllm bench sends (with ``--ignore-eos --temperature 0``): chat puts the prompt in a text part and
    caps with ``max_completion_tokens``; completions sends ``max_tokens``, ``logprobs: null`` and
    ``repetition_penalty: 1.0``. The URL must end in ``chat/completions`` or ``completions``."""
    if api_url.endswith("chat/completions"):
        payload: dict[str, Any] = {
            "model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
            "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True}}
    else:
        assert api_url.endswith("completions")
        payload = {"model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
                   "logprobs": None, "stream": True, "stream_options": {"include_usage": True}}
    payload["ignore_eos"] = True
    payload.update(GREEDY)
    return payload


async def vllm_bench_request(session: BenchSession, api_url: str, payload: dict[str, Any]) -> BenchOutput:
    """``async_request_openai_chat_completions`` / ``async_request_openai_completions``: the same timing and
    usage logic, the chat one reading ``delta.content`` and the completions one ``text``."""
    chat = api_url.endswith("chat/completions")
    output = BenchOutput()
    st = time.perf_counter()
    most_recent = st
    headers = {"Content-Type": "application/json"} if chat else {}
    try:
        async with session.post(api_url, payload, headers) as (status, reason, body):
            if status != 200:
                output.error = f"{status} {reason}"  # vllm bench keeps only the reason
                return output
            handler = StreamedResponseHandler()
            async for chunk_bytes in body:
                if not (chunk_bytes := chunk_bytes.strip()):
                    continue
                for message in handler.add_chunk(chunk_bytes):
                    if message.startswith(":"):  # SSE comments (pings) are skipped
                        continue
                    chunk = message.removeprefix("data: ")
                    if chunk == "[DONE]":
                        continue
                    timestamp = time.perf_counter()
                    data = json.loads(chunk)
                    if choices := data.get("choices"):
                        text = choices[0]["delta"].get("content") if chat else choices[0].get("text")
                        if not output.token_chunks:
                            output.ttft = timestamp - st
                        else:
                            output.itl.append(timestamp - most_recent)
                        output.generated_text += text or ""
                        most_recent = timestamp
                        output.token_chunks.append(data)
                    elif usage := data.get("usage"):
                        output.output_tokens = usage.get("completion_tokens")
                        output.prompt_len = usage.get("prompt_tokens", output.prompt_len)
                        output.usage_chunks.append(data)
            output.success = bool(output.token_chunks)
            if not output.success:
                output.error = "Never received a valid chunk to calculate TTFT."
            output.latency = most_recent - st
    except Exception as exc:  # vllm bench records the failure instead of raising
        output.error = repr(exc)
    return output


def run_vllm_bench(api_url: str, payloads: list[dict[str, Any]]) -> list[BenchOutput]:
    """All requests at once (``--max-concurrency len(payloads)``) through one session, under asyncio."""

    async def main() -> list[BenchOutput]:
        async with BenchSession() as session:
            return list(await asyncio.gather(*(vllm_bench_request(session, api_url, p) for p in payloads)))

    return asyncio.run(main())


def chat_prompt_len(server: ServerThread, text: str) -> int:
    """Prompt tokens of a one-message chat, by the server's own tokenizer and template."""
    tokenizer = server.engine.tokenizer
    messages = [{"role": "user", "content": text}]
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))


def whole_text(server: ServerThread, path: str, payload: dict[str, Any]) -> str:
    """The same request non-streamed: the greedy text the stream must add up to."""
    body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    with server.http() as http:
        choice = http.post(path, json=body).json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_vllm_bench_chat(server: ServerThread, model: str) -> None:
    """TTFT, token counts and text as vllm bench computes them for chat. Our first chunk with choices is the
    role-only delta (``content: ""``), as vLLM's: it is only honest if it leaves with the engine's first token,
    so the client's TTFT must be at least the engine's own (arrival to first token, from ``/metrics``); a role
    chunk sent before prefill would arrive after a loopback round trip, far sooner."""
    api_url = server.http_base + "/v1/chat/completions"
    prompts = [*EARLY_STOPPING_CHAT, LONG_TEXT]
    payloads = [vllm_bench_payload(api_url, model, p, OUTPUT_LEN) for p in prompts]
    before = server.metrics()
    outputs = run_vllm_bench(api_url, payloads)
    after = server.metrics()
    for prompt, payload, out in zip(prompts, payloads, outputs, strict=True):
        assert out.success and out.error == "", out.error
        assert out.output_tokens == OUTPUT_LEN  # ignore_eos honoured and counted in the usage chunk
        assert out.prompt_len == chat_prompt_len(server, prompt)
        first, second = out.token_chunks[0]["choices"][0], out.token_chunks[1]["choices"][0]
        assert first["delta"] == {"role": "assistant", "content": ""}  # vLLM's shape for the first chunk
        assert second["delta"].get("content") and "role" not in second["delta"]  # then the first token's text
        assert sum("role" in c["choices"][0]["delta"] for c in out.token_chunks) == 1
        finishes = [c["choices"][0]["finish_reason"] for c in out.token_chunks if c["choices"][0]["finish_reason"]]
        assert finishes == ["length"]
        assert len(out.usage_chunks) == 1
        assert 0 < out.ttft <= out.latency and len(out.itl) == len(out.token_chunks) - 1
        assert all(x >= 0 for x in out.itl)
        assert out.generated_text == whole_text(server, "/v1/chat/completions", payload)
    ttft_sum, ttft_count = "vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"
    assert after[ttft_count] - before.get(ttft_count, 0.0) == len(prompts)  # no other request in the window
    server_ttft = after[ttft_sum] - before.get(ttft_sum, 0.0)
    assert sum(o.ttft for o in outputs) >= server_ttft > 0


def test_vllm_bench_completions(server: ServerThread, model: str) -> None:
    """The completions client: no role chunk, so the first chunk with choices must carry the first token's
    text; here every token has text, so there is one chunk per token as in vLLM (ITL has OUTPUT_LEN-1 gaps)."""
    api_url = server.http_base + "/v1/completions"
    payloads = [vllm_bench_payload(api_url, model, p, OUTPUT_LEN) for p in COMPLETION_PROMPTS]
    outputs = run_vllm_bench(api_url, payloads)
    tokenizer = server.engine.tokenizer
    for prompt, payload, out in zip(COMPLETION_PROMPTS, payloads, outputs, strict=True):
        assert out.success and out.error == "", out.error
        assert out.output_tokens == OUTPUT_LEN
        assert out.prompt_len == len(tokenizer.encode(prompt))
        assert out.token_chunks[0]["choices"][0]["text"]
        assert len(out.token_chunks) == OUTPUT_LEN and len(out.itl) == OUTPUT_LEN - 1
        assert 0 < out.ttft <= out.latency
        assert out.generated_text == whole_text(server, "/v1/completions", payload)


def test_vllm_bench_one_chunk_per_token_through_special_tokens(server: ServerThread, model: str) -> None:
    """With vLLM every engine step (one token) gives one chunk, so vllm bench's ITL samples are per token: the
    role chunk at TTFT, then OUTPUT_LEN token chunks."""
    api_url = server.http_base + "/v1/chat/completions"
    (out,) = run_vllm_bench(api_url, [vllm_bench_payload(api_url, model, "Hi", OUTPUT_LEN)])
    assert out.success and out.output_tokens == OUTPUT_LEN
    assert len(out.itl) == OUTPUT_LEN


# ---------------------------------------------------------------------------------------------------------------
# guidellm 0.8.1's openai_http request shape


def guidellm_body(path: str, model: str, prompt: str) -> dict[str, Any]:
    """What guidellm's request handlers send for a synthetic row with ``output_tokens`` set (``stop: None`` is
    filtered out before sending): always streaming, always continuous usage, always ``ignore_eos``."""
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    if path.endswith("chat/completions"):
        body |= {"max_completion_tokens": OUTPUT_LEN, "ignore_eos": True,
                 "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}]}
    else:
        body |= {"max_tokens": OUTPUT_LEN, "ignore_eos": True, "prompt": prompt}
    return body | GREEDY


def stream_data(server: ServerThread, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Chunks read as guidellm reads them: httpx ``aiter_lines``, blank lines skipped, ``data:`` lines parsed,
    stopping at ``[DONE]``."""
    chunks = []
    with server.http() as http, http.stream("POST", path, json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not (line := line.strip()) or not line.startswith("data:"):
                continue
            if (payload := line[len("data:"):].strip()) == "[DONE]":
                break
            chunks.append(json.loads(payload))
    return chunks


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_continuous_usage_stats(server: ServerThread, model: str, path: str) -> None:
    """vLLM's ``continuous_usage_stats``: usage (running totals) on every chunk, one chunk per token, then the usage
    chunk with no choices. guidellm keeps the last usage it saw as the request's token counts and counts a token iteration per
    chunk with text, so the last usage must say OUTPUT_LEN and no chunk may claim fewer tokens than texts sent."""
    prompt = EARLY_STOPPING_CHAT[0]
    chunks = stream_data(server, path, guidellm_body(path, model, prompt))
    tokenizer = server.engine.tokenizer
    prompt_len = chat_prompt_len(server, prompt) if "chat" in path else len(tokenizer.encode(prompt))
    assert all(isinstance(c.get("usage"), dict) for c in chunks)
    usages = [c["usage"] for c in chunks]
    assert {u["prompt_tokens"] for u in usages} == {prompt_len}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    # One chunk per token (after chat's role chunk, which counts none yet), then the usage chunk: vLLM's counts.
    first = [0] if "chat" in path else []
    assert [u["completion_tokens"] for u in usages] == first + list(range(1, OUTPUT_LEN + 1)) + [OUTPUT_LEN]
    assert chunks[-1]["choices"] == [] and all(c["choices"] for c in chunks[:-1])
    texts = 0
    for c in chunks[:-1]:
        choice = c["choices"][0]
        texts += bool(choice["delta"].get("content") if "chat" in path else choice["text"])
        assert texts <= c["usage"]["completion_tokens"] <= OUTPUT_LEN
    assert 0 < texts <= OUTPUT_LEN


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_usage_options_follow_vllm(server: ServerThread, model: str, path: str) -> None:
    """``include_usage`` alone: ``usage: null`` on every chunk but the final one (what vllm bench relies on to
    tell the usage chunk apart). ``continuous_usage_stats`` alone does nothing in vLLM (it needs include_usage)."""
    body = guidellm_body(path, model, "Hi") | {"max_completion_tokens" if "chat" in path else "max_tokens": 3}
    only_final = stream_data(server, path, body | {"stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in only_final[:-1])
    assert only_final[-1]["choices"] == [] and only_final[-1]["usage"]["completion_tokens"] == 3
    neither = stream_data(server, path, body | {"stream_options": {"continuous_usage_stats": True}})
    assert neither and all(c.get("usage") is None and c["choices"] for c in neither)
