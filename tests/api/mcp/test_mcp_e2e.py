"""MCP tools end to end: the official ``openai`` client against our server (real engine on the scripted model
of test_e2e_tools) with real MCP servers written with the ``mcp`` SDK, one over stdio (started by the server),
one over streamable HTTP on loopback.

The expected tools are listed by the SDK's own client straight from the demo server (not through our manager),
and the expected prompt is the chat template rendered with them; the model's script is the call a model would
write, so what comes back to the client is known from the script literal.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import jsonschema
import pytest
import trio
from mcp import Client

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.mcp.config import McpServerSpec
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.models import registry
from tests.api.conftest import ServerThread, running, tcp_bind
from tests.api.mcp.conftest import HttpDemo, read_pid, stdio_spec
from tests.api.test_e2e_tools import (
    ARCH,
    ASK,
    CALL_ID,
    TOOLS,
    Chat,
    ScriptedForCausalLM,
    accumulate,
    write_model,
)

REFRESH_S = 0.5
CALL = {"name": "remote_get_weather", "arguments": {"city": "Paris", "unit": "fahrenheit", "days": 2}}
SCRIPT = f"I will check.\n<tool_call>\n{json.dumps(CALL)}\n</tool_call>"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpDemo]:
    http = HttpDemo(tmp_path_factory.mktemp("mcp_http") / "http.log").start()
    try:
        yield http
    finally:
        http.kill()


@pytest.fixture(scope="module")
def sdk_tools(demo: HttpDemo) -> list[Any]:
    """The demo server's tools as the SDK's client lists them (the oracle for names, texts and schemas)."""

    async def listing() -> list[Any]:
        async with Client(demo.url) as client:
            return list((await client.list_tools()).tools)

    return trio.run(listing)


def expected_tools(sdk_tools: list[Any], *server_ids: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"{sid}_{t.name}", "description": t.description,
                                              "parameters": t.input_schema}}
            for sid in server_ids for t in sdk_tools]


@pytest.fixture(scope="module")
def local_pid_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the stdio demo server (started by our server) writes its pid."""
    return tmp_path_factory.mktemp("mcp_stdio") / "local.pid"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, demo: HttpDemo, local_pid_file: Path
           ) -> Iterator[ServerThread]:
    path = tmp_path_factory.mktemp("scripted_mcp")
    write_model(path)
    mcp = [stdio_spec("local", local_pid_file), McpServerSpec("remote", url=demo.url)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(registry.MODEL_REGISTRY, ARCH, ScriptedForCausalLM)
        args = EngineArgs(model=str(path), load_format="dummy", dtype="f32", mem=16, max_num_seqs=4,
                          disable_prefix_cache=True)
        config = ServerConfig(enforce_parser="qwen", served_model_names=["scripted"], mcp_servers=mcp,
                              mcp_refresh_s=REFRESH_S)
        with running(lambda: open_engine(args), config, tcp_bind()) as srv:
            yield srv


@pytest.fixture(scope="module")
def chat(server: ServerThread) -> Chat:
    return Chat(server)


def test_mcp_tools_are_in_the_prompt_when_the_request_brings_none(chat: Chat, sdk_tools: list[Any]) -> None:
    offered = expected_tools(sdk_tools, "local", "remote")
    assert [t["function"]["name"] for t in offered] == [
        "local_add", "local_get_weather", "remote_add", "remote_get_weather"]
    prompt = chat.prompt_ids(ASK, offered)
    answer = chat.create("It is sunny.", prompt)
    assert chat.model.prompts[-1] == prompt and answer.usage.prompt_tokens == len(prompt)
    assert answer.choices[0].message.content == "It is sunny."

    own = chat.prompt_ids(ASK, TOOLS)  # the request's own tools replace the MCP ones
    chat.create("Fine.", own, tools=TOOLS)
    assert chat.model.prompts[-1] == own
    bare = chat.prompt_ids(ASK)  # tool_choice none offers nothing
    chat.create("Fine.", bare, tool_choice="none")
    assert chat.model.prompts[-1] == bare


def test_tokenize_counts_the_prompt_a_chat_request_would_get(chat: Chat, server: ServerThread,
                                                            sdk_tools: list[Any]) -> None:
    body = {"model": "scripted", "messages": ASK}
    got = httpx2.post(f"{server.urls[0]}/tokenize", json=body, timeout=30).json()
    assert got["tokens"] == chat.prompt_ids(ASK, expected_tools(sdk_tools, "local", "remote"))
    own = httpx2.post(f"{server.urls[0]}/tokenize", json={**body, "tools": TOOLS}, timeout=30).json()
    assert own["tokens"] == chat.prompt_ids(ASK, TOOLS)


def test_a_call_of_an_mcp_tool_comes_back_to_the_client(chat: Chat, demo: HttpDemo, sdk_tools: list[Any]) -> None:
    prompt = chat.prompt_ids(ASK, expected_tools(sdk_tools, "local", "remote"))
    whole = chat.create(SCRIPT, prompt)
    msg = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and msg.content.strip() == "I will check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        (CALL["name"], CALL["arguments"])]
    assert CALL_ID.match(msg.tool_calls[0].id)
    schema = next(t.input_schema for t in sdk_tools if t.name == "get_weather")
    jsonschema.validate(json.loads(msg.tool_calls[0].function.arguments), schema)

    got = accumulate(list(chat.create(SCRIPT, prompt, stream=True)))
    assert got["finish"] == ["tool_calls"] and got["content"].strip() == "I will check."
    assert [(c["name"], c["arguments"]) for c in got["calls"]] == [
        (msg.tool_calls[0].function.name, msg.tool_calls[0].function.arguments)]

    async def execute() -> Any:  # what a client does with the call: send it to the server the prefix names
        name, arguments = got["calls"][0]["name"], json.loads(got["calls"][0]["arguments"])
        async with Client(demo.url) as client:
            return await client.call_tool(name.removeprefix("remote_"), arguments)

    result = trio.run(execute)
    assert not result.is_error and "sunny in Paris for 2 day(s), 21 degrees fahrenheit" in result.content[0].text


def test_a_killed_mcp_server_is_skipped_without_failing_requests(chat: Chat, local_pid_file: Path,
                                                                 sdk_tools: list[Any]) -> None:
    both = chat.prompt_ids(ASK, expected_tools(sdk_tools, "local", "remote"))
    remote_only = chat.prompt_ids(ASK, expected_tools(sdk_tools, "remote"))
    first = read_pid(local_pid_file)
    os.kill(first, signal.SIGKILL)
    seen = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (remote_only not in seen or seen[-1] != both):
        answer = chat.create("Fine.", both)  # every request must succeed, whatever the MCP servers do
        seen.append(chat.model.prompts[-1])
        assert seen[-1] in (both, remote_only) and answer.choices[0].finish_reason == "stop"
        if seen[-1] == both:  # the script is placed for this prompt's length
            assert answer.choices[0].message.content == "Fine."
        time.sleep(0.1)
    assert remote_only in seen, "the killed server's tools were still offered"
    assert seen[-1] == both, "the restarted server's tools did not come back"
    assert read_pid(local_pid_file) != first
