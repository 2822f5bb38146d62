"""Server sampling defaults (``--temperature`` and friends) reach every chat request that leaves the field unset,
including those whose parameters the chat route adjusts (tools keep special tokens; a named tool is a grammar):
a server whose default temperature is 0 must answer them greedily, the same every time."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
MESSAGES = [{"role": "user", "content": "What is the weather like in Paris today? Answer in a sentence."}]


@pytest.fixture(scope="module")
def greedy_server() -> Iterator[ServerThread]:
    args = EngineArgs(model=str(smollm2_path()), temperature=0.0, max_num_seqs=4)
    config = ServerConfig(keepalive_s=5.0, enforce_parser="qwen")  # a parser: tool requests keep special tokens
    with running(lambda: open_engine(args), config, tcp_bind()) as srv:
        yield srv


@pytest.mark.parametrize("extra", [
    {"tools": [TOOL]},  # tool_choice auto: the route keeps special tokens for the parser
    {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}},  # a grammar
], ids=["auto", "named"])
def test_unset_fields_take_the_server_defaults(greedy_server: ServerThread, extra: dict[str, Any]) -> None:
    client = greedy_server.openai()
    model = client.models.list().data[0].id

    def answer(**kw: Any) -> tuple[str | None, list[str]]:
        msg = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=40, **extra,  # type: ignore[arg-type]
                                             **kw).choices[0].message
        return msg.content, [c.function.arguments for c in msg.tool_calls or []]  # type: ignore[union-attr]

    greedy = answer(temperature=0)
    assert [answer() for _ in range(3)] == [greedy] * 3
