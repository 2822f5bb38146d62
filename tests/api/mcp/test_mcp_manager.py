"""McpManager against real MCP servers (the official SDK's MCPServer): over stdio as a command the manager
starts, and over streamable HTTP on loopback; dead and unusable servers are skipped and retried."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import jsonschema
import pydantic
import pytest
import trio
from openai.types.chat import ChatCompletionFunctionToolParam

from candle_vllm.api.mcp.config import McpServerSpec
from candle_vllm.api.mcp.manager import McpManager
from tests.api.mcp.conftest import DEMO_TOOLS, HttpDemo, free_port, is_alive, read_pid, stdio_spec

T = TypeVar("T")
REFRESH_S = 0.3
OPENAI_TOOL = pydantic.TypeAdapter(ChatCompletionFunctionToolParam)


def with_manager(mgr: McpManager, body: Callable[[McpManager], Awaitable[T]]) -> T:
    """Run ``mgr`` as the server does (started in a nursery, stopped at the end) around ``body``."""

    async def main() -> T:
        async with trio.open_nursery() as nursery:
            with trio.fail_after(60):
                await nursery.start(mgr.run)
            result = await body(mgr)
            mgr.stop()
        return result

    return trio.run(main)


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    with trio.fail_after(timeout_s):
        while not predicate():
            await trio.sleep(0.05)


def names(mgr: McpManager) -> set[str]:
    return {t["function"]["name"] for t in mgr.tools()}


def by_name(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {t["function"]["name"]: t["function"] for t in tools}


def test_tools_of_stdio_and_http_servers_as_openai_tools(tmp_path: Path, http_demo: HttpDemo) -> None:
    specs = [stdio_spec("local", tmp_path / "local.pid"), McpServerSpec("remote", url=http_demo.url)]

    async def body(mgr: McpManager) -> list[dict[str, Any]]:
        return mgr.tools()  # right after start: the first listings are done

    tools = with_manager(McpManager(specs, REFRESH_S), body)
    assert [t["function"]["name"] for t in tools] == [f"{sid}_{n}" for sid in ("local", "remote") for n in DEMO_TOOLS]
    for tool in tools:
        OPENAI_TOOL.validate_python(tool)
        jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    fns = by_name(tools)
    for sid in ("local", "remote"):
        add, weather = fns[f"{sid}_add"], fns[f"{sid}_get_weather"]
        assert add["description"] == "Add two integers and return the sum."
        assert weather["description"] == "Weather forecast for a city."
        assert {k: v["type"] for k, v in add["parameters"]["properties"].items()} == {"a": "integer", "b": "integer"}
        assert sorted(add["parameters"]["required"]) == ["a", "b"]
        assert weather["parameters"]["required"] == ["city"]
        check = jsonschema.Draft202012Validator(weather["parameters"])
        assert check.is_valid({"city": "Paris", "unit": "fahrenheit", "days": 3})
        assert not check.is_valid({"city": "Paris", "unit": "kelvin"})
        assert not check.is_valid({"unit": "celsius"})
        assert not jsonschema.Draft202012Validator(add["parameters"]).is_valid({"a": 1.5, "b": 2})


def test_a_killed_server_is_skipped_then_retried(tmp_path: Path, http_demo: HttpDemo) -> None:
    pid_file = tmp_path / "local.pid"
    specs = [stdio_spec("local", pid_file), McpServerSpec("remote", url=http_demo.url)]
    local = {"local_add", "local_get_weather"}
    remote = {"remote_add", "remote_get_weather"}

    async def body(mgr: McpManager) -> None:
        first = read_pid(pid_file)
        assert names(mgr) == local | remote
        os.kill(first, signal.SIGKILL)
        await wait_for(lambda: names(mgr) == remote)  # skipped at the next refresh
        assert mgr.connected == ["remote"]
        await wait_for(lambda: names(mgr) == local | remote)  # the command is started again
        assert read_pid(pid_file) != first
        await trio.to_thread.run_sync(http_demo.kill)
        await wait_for(lambda: names(mgr) == local)
        await trio.to_thread.run_sync(lambda: http_demo.start(MCP_DEMO_EXTRA_TOOL="1"))
        await wait_for(lambda: names(mgr) == local | remote | {"remote_echo"})

    with_manager(McpManager(specs, REFRESH_S), body)


def test_unusable_servers_are_logged_and_never_stop_the_manager(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    specs = [
        McpServerSpec("missing", command=str(tmp_path / "no-such-command")),
        McpServerSpec("notmcp", command=sys.executable, args=("-c", "print('hello, not MCP')")),
        McpServerSpec("closed", url=f"http://127.0.0.1:{free_port()}/mcp"),
        stdio_spec("good", tmp_path / "good.pid"),
    ]

    async def body(mgr: McpManager) -> None:
        assert names(mgr) == {"good_add", "good_get_weather"}
        await trio.sleep(4 * REFRESH_S)  # several retries of the bad ones
        assert names(mgr) == {"good_add", "good_get_weather"}
        assert mgr.connected == ["good"]

    with caplog.at_level(logging.INFO, logger="candle_vllm.api.mcp.manager"):
        with_manager(McpManager(specs, REFRESH_S), body)
    for sid in ("missing", "notmcp", "closed"):
        mine = [r for r in caplog.records if f"MCP server '{sid}'" in r.getMessage()]
        assert mine[0].levelno == logging.WARNING and "unavailable" in mine[0].getMessage()
        assert len(mine) >= 3 and all(r.levelno == logging.INFO for r in mine[1:])  # retried, warned once


def test_stop_ends_the_sessions_and_the_stdio_servers(tmp_path: Path) -> None:
    pid_file = tmp_path / "local.pid"
    mgr = McpManager([stdio_spec("local", pid_file)], refresh_s=60)

    async def main() -> float:
        async with trio.open_nursery() as nursery:
            await nursery.start(mgr.run)
            assert names(mgr) == {"local_add", "local_get_weather"}
            start = trio.current_time()
            mgr.stop()
        return trio.current_time() - start

    took = trio.run(main)
    assert took < 5.0
    assert not is_alive(read_pid(pid_file))


def test_refresh_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="refresh interval"):
        McpManager([], refresh_s=0)
