"""Structured output end to end: the official ``openai`` client against our server on the real SmolLM2 engine.
``response_format`` json_object / json_schema (chat and completions, whole and streamed) and vLLM's
``guided_json`` give JSON that parses and validates (``jsonschema``); unusable schemas and unsupported
guided-decoding fields are OpenAI-shaped 400s naming the parameter."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 30},
        "country": {"type": "string", "maxLength": 30},
        "population": {"type": "integer", "minimum": 0},
        "size": {"enum": ["small", "medium", "large"]},
        "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "population", "size", "landmarks"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe Paris as JSON."}]


def schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    args = EngineArgs(model=str(smollm2_path()), mem=256, max_num_seqs=32)
    with running(lambda: open_engine(args), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return server.openai()


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_json_schema_whole_and_streamed(client: openai.OpenAI, model: str) -> None:
    whole = client.chat.completions.create(model=model, messages=ASK, temperature=1.0, seed=5, n=3, max_tokens=120,
                                           response_format=schema_format(CITY))
    for choice in whole.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content or ""), CITY)
    chunks = list(client.chat.completions.create(model=model, messages=ASK, temperature=1.0, seed=5, max_tokens=120,
                                                 response_format=schema_format(CITY), stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    jsonschema.validate(json.loads(text), CITY)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]


def test_chat_json_object(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": 'Reply with a JSON object like {"answer": "yes"}.'}]
    r = client.chat.completions.create(model=model, messages=messages, temperature=0.7, seed=1, n=4, max_tokens=60,
                                       response_format={"type": "json_object"})
    parsed = [json.loads(c.message.content or "") for c in r.choices if c.finish_reason == "stop"]
    assert parsed and all(isinstance(p, dict) for p in parsed)
    # Cut by max_tokens, an object is unfinished but still a prefix the grammar allowed: it starts with '{'.
    assert all((c.message.content or "").startswith("{") for c in r.choices)


def test_completions_response_format_and_guided_json(client: openai.OpenAI, model: str) -> None:
    prompt = "A JSON description of Rome:"
    r = client.completions.create(model=model, prompt=prompt, temperature=1.0, seed=2, n=2, max_tokens=120,
                                  extra_body={"response_format": schema_format(CITY)})
    for c in r.choices:
        jsonschema.validate(json.loads(c.text), CITY)
    g = client.completions.create(model=model, prompt=prompt, temperature=1.0, seed=3, max_tokens=120,
                                  extra_body={"guided_json": json.dumps(CITY)})
    jsonschema.validate(json.loads(g.choices[0].text), CITY)


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "strin"}}})},
     "response_format", "Invalid type"),
    ({"response_format": schema_format({"type": "array", "uniqueItems": True})}, "response_format",
     "uniqueItems"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format", None),
    ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 1}}, "guided_json", "Unsatisfiable"),
    ({"guided_regex": "[a-z]+"}, "guided_regex", "not supported"),
    ({"guided_choice": ["a", "b"]}, "guided_choice", "not supported"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "structured_output"),
])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_unusable_requests_are_400(client: openai.OpenAI, model: str, route: str, body: dict[str, Any], param: str | None,
                                   message: str | None) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model=model, messages=ASK, max_tokens=5, extra_body=body)
        else:
            client.completions.create(model=model, prompt="hi", max_tokens=5, extra_body=body)
    err = info.value.body if "message" in info.value.body else info.value.body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == param or err["param"].startswith(f"{param}.")  # pydantic names the nested field
    if message is not None:
        assert message in err["message"]
