"""``tool_choice: "required"`` end to end: the official ``openai`` client against our server running the real
engine on the embedded SmolLM2. The output is constrained to a JSON list of calls; the call objects must be
closed (``additionalProperties: false``), or the small model keeps adding keys until ``max_tokens``. A stream
cut by ``max_tokens`` must accumulate to the non-streamed response: no text sent both as a call and as content.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind


def _tool(name: str, description: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": properties, "required": required}}}


WEATHER = _tool("get_weather", "Get the current weather in a city",
                {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["city"])
TIME = _tool("get_time", "Current time in a time zone", {"timezone": {"type": "string"}}, ["timezone"])
CONVERT = _tool("convert_currency", "Convert an amount of money",
                {"amount": {"type": "number"}, "from_currency": {"type": "string"},
                 "to_currency": {"type": "string"}}, ["amount", "from_currency", "to_currency"])
EMAIL = _tool("send_email", "Send an email",
              {"to": {"type": "string"}, "subject": {"type": "string"}, "body": {"type": "string"}}, ["to", "body"])
CASES = [
    ("What's the weather in Paris?", [WEATHER]),
    ("What time is it in Tokyo?", [WEATHER, TIME]),
    ("Convert 100 US dollars to euros.", [CONVERT, WEATHER]),
    ("Email bob@example.com to say the meeting moved to 3pm.", [EMAIL]),
    ("Is it raining in London right now?", [WEATHER, TIME]),
]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    args = EngineArgs(model=str(smollm2_path()), mem=64, max_num_seqs=8)
    with running(lambda: open_engine(args), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


def _create(server: ServerThread, question: str, tools: list[dict[str, Any]], max_tokens: int, **kw: Any) -> Any:
    return server.openai().chat.completions.create(
        model=server.engine.model_name, messages=[{"role": "user", "content": question}], tools=tools,
        tool_choice="required", max_tokens=max_tokens, temperature=0, **kw)


@pytest.mark.parametrize(("question", "tools"), CASES, ids=[c[1][0]["function"]["name"] + str(i)
                                                            for i, c in enumerate(CASES)])
def test_required_answers_with_calls_whose_arguments_are_json(server: ServerThread, question: str,
                                                              tools: list[dict[str, Any]]) -> None:
    r = _create(server, question, tools, max_tokens=200)
    choice = r.choices[0]
    calls = choice.message.tool_calls or []
    assert calls, (choice.finish_reason, choice.message.content)
    assert choice.message.content is None
    names = {t["function"]["name"] for t in tools}
    assert all(c.function.name in names for c in calls)
    # Every call is whole, except the last one of an output cut by max_tokens (the model may repeat calls, or
    # loop inside one string argument until the cut: greedy decoding of a 135M model).
    whole = calls if choice.finish_reason == "tool_calls" else calls[:-1]
    assert choice.finish_reason in ("tool_calls", "length")
    assert calls[-1].function.arguments.startswith("{")
    for call in whole:
        args = json.loads(call.function.arguments)
        required = next(t for t in tools if t["function"]["name"] == call.function.name)["function"]["parameters"]
        assert isinstance(args, dict) and set(required["required"]) <= set(args), call.function.arguments


def _accumulate(chunks: list[Any]) -> tuple[str | None, list[tuple[str, str]], str | None]:
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            call = calls.setdefault(tc.index, ["", ""])
            call[0] += tc.function.name or ""
            call[1] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content or None, [(calls[i][0], calls[i][1]) for i in sorted(calls)], finish


def test_a_cut_required_stream_equals_the_whole_response(server: ServerThread) -> None:
    """Cut at several points: before the name, inside the arguments, right after them. Both answers hold the
    calls read so far (arguments as far as they got) and nothing else."""
    cut_inside_a_call = 0
    for max_tokens in (6, 12, 15, 20):
        whole = _create(server, "What's the weather in Paris?", [WEATHER], max_tokens)
        msg = whole.choices[0].message
        expected = (msg.content, [(c.function.name, c.function.arguments) for c in msg.tool_calls or []],
                    whole.choices[0].finish_reason)
        streamed = _accumulate(list(_create(server, "What's the weather in Paris?", [WEATHER], max_tokens,
                                            stream=True)))
        assert streamed == expected, max_tokens
        assert expected[2] == "length"
        if expected[1]:
            assert expected[0] is None, "a call's text is never content as well"
            cut_inside_a_call += 1
    assert cut_inside_a_call >= 2  # the cases really cut calls, not only the text before them
