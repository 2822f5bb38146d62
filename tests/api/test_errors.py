"""Every error class answers OpenAI's shape and makes the official SDK raise its matching exception."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from candle_vllm.api.state import ServerConfig
from tests.api.conftest import ServerThread, engine_cm, running, tcp_bind
from tests.api.fake_engine import FakeEngine

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(smol_tokenizer) -> Iterator[ServerThread]:
    engine = FakeEngine(smol_tokenizer, max_model_len=64, reject_prompts_longer_than=40)
    config = ServerConfig(max_body_bytes=64 * 1024, trust_request_chat_template=True)  # template errors below
    with running(engine_cm(engine), config, tcp_bind()) as srv:
        yield srv


def assert_openai_error(body: Any) -> None:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"n": 0}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"seed": 2**64}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"max_tokens": 60}, "max_tokens"),  # prompt + max_tokens over the 64-token context
        ({"stream_options": {"include_usage": True}}, None),  # without stream
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
         "response_format"),
        ({"logit_bias": {"999999": 1.0}}, None),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content"),
    ],
)
def test_bad_chat_requests_are_400(server: ServerThread, kwargs: dict[str, Any], param: str | None) -> None:
    body = {"model": "fake-model", "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(**body)
    assert_openai_error(info.value.body if "error" in info.value.body else {"error": info.value.body})
    if param is not None:
        assert info.value.param == param, info.value.message


def test_prompt_over_context_is_400(server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().completions.create(model="fake-model", prompt="word " * 80)
    assert info.value.param == "input_tokens" and "maximum context length is 64" in info.value.message


def test_engine_rejection_is_400(server: ServerThread) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match="--kv-fraction"):
            server.openai().completions.create(model="fake-model", prompt="word " * 45, max_tokens=2, stream=stream)


def test_bad_completion_prompts(server: ServerThread) -> None:
    client = server.openai()
    for prompt in ([], [""], [[1, 2], []], [10**9], [1, "a"]):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="fake-model", prompt=prompt, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model="fake-model", prompt="a", suffix="b", max_tokens=2)


def test_template_error_is_400(server: ServerThread) -> None:
    with pytest.raises(openai.BadRequestError, match="boom"):
        server.openai().chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"chat_template": "{{ raise_exception('boom') }}"})
    with pytest.raises(openai.BadRequestError, match="template"):
        server.openai().chat.completions.create(
            model="fake-model", messages=MESSAGES, extra_body={"chat_template": "{% if %}"})


def test_unknown_model_is_404(server: ServerThread) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        server.openai().chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        server.openai().models.retrieve("gpt-9")
    assert server.openai().models.retrieve("fake-model").id == "fake-model"


def test_unknown_route_method_and_body_errors(server: ServerThread) -> None:
    with server.http() as http:
        cases = [
            (http.get("/v1/nothing"), 404),
            (http.get("/v1/chat/completions"), 405),
            (http.post("/v1/chat/completions", content=b"{not json"), 400),
            (http.post("/v1/chat/completions", content=b"[1, 2]"), 400),
            (http.post("/v1/chat/completions", content=b"{}", headers={"Content-Type": "text/plain"}), 415),
            (http.post("/v1/completions", json={"prompt": "x" * (70 * 1024)}), 413),
            (http.post("/detokenize", json={"tokens": [10**9]}), 400),
            (http.post("/tokenize", json={}), 400),
        ]
        for response, status in cases:
            assert response.status_code == status, response.text
            assert_openai_error(response.json())
    with pytest.raises(openai.APIStatusError) as info:
        server.openai().completions.create(model="fake-model", prompt="x" * (70 * 1024))
    assert info.value.status_code == 413


def test_api_key(smol_tokenizer) -> None:
    engine = FakeEngine(smol_tokenizer)
    with running(engine_cm(engine), ServerConfig(api_key="sesame"), tcp_bind()) as srv:
        for key in ("wrong", "sesame2"):
            with pytest.raises(openai.AuthenticationError):
                srv.openai(api_key=key).chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=2)
        with srv.http() as http:
            assert http.get("/v1/models").status_code == 401
            assert_openai_error(http.get("/v1/models").json())
            assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
            assert http.get("/ping").status_code == 200 and http.get("/load").status_code == 200  # probes
        r = srv.openai(api_key="sesame").chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=2)
        assert r.choices[0].finish_reason == "length"


def test_overload_is_503_with_retry_after(smol_tokenizer) -> None:
    engine = FakeEngine(smol_tokenizer, delay_s=0.5)
    with running(engine_cm(engine), ServerConfig(max_pending_requests=1), tcp_bind()) as srv:
        with srv.http() as http, http.stream("POST", "/v1/completions",
                                             json={"prompt": "a", "stream": True, "max_tokens": 4}) as first:
            lines = first.iter_lines()  # closing this iterator would close the connection
            next(lines)
            second = http.post("/v1/completions", json={"prompt": "b", "max_tokens": 2})
            assert second.status_code == 503 and int(second.headers["Retry-After"]) >= 1
            assert_openai_error(second.json())
            assert http.get("/load").json() == {"server_load": 1}  # the stream in flight
        with srv.http() as http, http.stream("POST", "/v1/completions",
                                             json={"prompt": "a", "stream": True, "max_tokens": 4}) as first:
            lines = first.iter_lines()
            next(lines)
            with pytest.raises(openai.InternalServerError) as info:
                srv.openai().completions.create(model="fake-model", prompt="b", max_tokens=2)
        assert info.value.status_code == 503


def test_error_after_stream_start_is_error_chunk_then_done(smol_tokenizer) -> None:
    class FailingEngine(FakeEngine):
        async def generate(self, *args: Any, **kwargs: Any) -> Any:
            count = 0
            async for out in super().generate(*args, **kwargs):
                yield out
                count += 1
                if count == 2:
                    raise RuntimeError("device lost")

    with running(engine_cm(FailingEngine(smol_tokenizer)), ServerConfig(), tcp_bind()) as srv:
        with srv.http() as http:
            raw = http.post("/v1/chat/completions", json={"messages": MESSAGES, "stream": True}).text
        events = [b[len("data: "):] for b in raw.split("\n\n") if b.startswith("data: ")]
        assert events[-1] == "[DONE]" and '"error"' in events[-2] and "device lost" in events[-2]
        with pytest.raises(openai.APIError, match="device lost"):
            for _ in srv.openai().chat.completions.create(model="fake-model", messages=MESSAGES, stream=True):
                pass
        # A Responses stream ends as response.failed, with the text so far and the error
        events = list(srv.openai().responses.create(model="fake-model", input="the cat", stream=True))
        assert events[-1].type == "response.failed" and "device lost" in events[-1].response.error.message
        assert events[-1].response.output[0].content[0].text == "".join(
            e.delta for e in events if e.type == "response.output_text.delta")
        assert srv.is_alive


def test_error_answer_waits_for_the_body_so_the_connection_stays_usable(server: ServerThread) -> None:
    """A refusal sent mid-upload used to close the connection under the client (pooled clients then hung)."""
    import socket
    import time

    host, port = server.urls[0].split("//")[1].rsplit(":", 1)
    body = b'{"prompt": "' + b"y" * 20000 + b'"}'
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: text/plain\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(0.3)  # the server has the headers, not the body, when it decides to refuse
        s.sendall(body)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        received = b""
        while received.count(b"HTTP/1.1 ") < 2:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {received[:200]!r}"
            received += chunk
    first, second = received.split(b"HTTP/1.1 ")[1:3]
    assert first.startswith(b"415") and second.startswith(b"200")


UNBUILT_EXTRAS = [("length_penalty", 0.5), ("logits_processors", ["x"])]


@pytest.mark.parametrize(("field", "value"), UNBUILT_EXTRAS)
def test_vllm_extras_that_are_not_built_are_400_not_ignored(server: ServerThread, field: str, value: Any) -> None:
    """vLLM request fields that would change the output are refused, naming the field, instead of being kept and
    ignored (the models keep unknown fields)."""
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=2,
                                                extra_body={field: value})
    assert info.value.param == field


@pytest.mark.parametrize(("field", "value"), UNBUILT_EXTRAS)
def test_completions_refuse_them_too(server: ServerThread, field: str, value: Any) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.openai().completions.create(model="fake-model", prompt="hi", max_tokens=2, extra_body={field: value})
    assert info.value.param == field


def test_their_neutral_values_are_accepted(server: ServerThread) -> None:
    """Clients that send vLLM's defaults for those fields (nothing to change) are served."""
    neutral = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "allowed_token_ids": None,
               "spaces_between_special_tokens": True, "return_tokens_as_token_ids": False, "priority": 0}
    client = server.openai()
    assert client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=2,
                                          extra_body={**neutral, "echo": False}).choices
    assert client.completions.create(model="fake-model", prompt="hi", max_tokens=2, extra_body=neutral).choices
