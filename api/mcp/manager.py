"""Keep a live list of the tools that the configured MCP servers offer, for requests that bring no tools.

One trio task per server holds an MCP session (official ``mcp`` SDK, which runs on anyio and so under the
server's trio loop), lists the server's tools at once and then every ``refresh_s`` seconds. A server that cannot
start, times out or dies loses its tools, is logged, and is tried again a refresh later; nothing an MCP server
does can fail a chat request or stop the API. The server never calls the tools: clients execute the calls, as
with the Rust candle-vllm.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import sys
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx2
import trio
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Implementation

from candle_vllm import __version__
from candle_vllm.api.mcp.config import DEFAULT_REFRESH_S, McpServerSpec
from candle_vllm.api.mcp.tools import merge_tools, openai_tool

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup  # trio's dependency on 3.10

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 20.0  # start (or reach) a server and list its tools; startup waits at most this long
CALL_TIMEOUT_S = 10.0  # one tools/list on a live session
MAX_PAGES = 100  # tools/list pages per listing: a server whose cursor never ends cannot hang the refresh
HTTP_TIMEOUT = httpx2.Timeout(30.0, read=300.0)  # the SDK's own defaults for its HTTP transport


class McpManager:
    """The MCP servers' tools as OpenAI tool dicts named ``ID_TOOLNAME``, kept fresh in the background."""

    def __init__(self, servers: Sequence[McpServerSpec], refresh_s: float = DEFAULT_REFRESH_S) -> None:
        if refresh_s <= 0:
            raise ValueError(f"the MCP refresh interval must be > 0 seconds, got {refresh_s}")
        self.servers = list(servers)
        self.refresh_s = refresh_s
        self._by_server: dict[str, list[dict[str, Any]]] = {}
        self._tools: list[dict[str, Any]] = []
        self._scope = trio.CancelScope()

    def tools(self) -> list[dict[str, Any]]:
        """The tools of the servers reachable at their last refresh (a copy: callers may change it freely)."""
        return copy.deepcopy(self._tools)

    @property
    def connected(self) -> list[str]:
        """Ids of the servers whose last listing succeeded, in config order."""
        return [s.id for s in self.servers if s.id in self._by_server]

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until ``stop()`` or cancellation; ``started`` once every server's first attempt has ended
        (listed or failed), so the API's first request already sees the tools of the servers that are up."""
        with self._scope:
            async with trio.open_nursery() as nursery:
                first = [trio.Event() for _ in self.servers]
                for spec, attempted in zip(self.servers, first, strict=True):
                    nursery.start_soon(self._keep, spec, attempted)
                for attempted in first:
                    await attempted.wait()
                task_status.started()

    def stop(self) -> None:
        """End every session (stdio servers get their stdin closed, then are terminated if they linger)."""
        self._scope.cancel()

    async def _keep(self, spec: McpServerSpec, attempted: trio.Event) -> None:
        failures = 0
        while True:
            try:
                await self._session(spec, attempted)
            except Exception as exc:  # whatever a server does wrong, the API must keep serving
                failures = failures + 1 if spec.id not in self._by_server else 1
                log.log(logging.WARNING if failures == 1 else logging.INFO,
                        "MCP server %s is unavailable (%s); its tools are left out, retrying every %g s",
                        spec.describe(), _reason(exc), self.refresh_s)
            self._set_tools(spec.id, None)
            attempted.set()
            await trio.sleep(self.refresh_s)

    async def _session(self, spec: McpServerSpec, attempted: trio.Event) -> None:
        # One scope around the whole session (the SDK's task groups live inside the client context, so a
        # timeout scope may not end before it does); its deadline bounds connecting and each listing only.
        with trio.CancelScope(deadline=trio.current_time() + CONNECT_TIMEOUT_S) as scope:
            async with _connect(spec) as client:
                await self._refresh(spec, client)
                scope.deadline = math.inf
                attempted.set()
                while True:
                    await trio.sleep(self.refresh_s)
                    scope.deadline = trio.current_time() + CALL_TIMEOUT_S
                    await self._refresh(spec, client)
                    scope.deadline = math.inf
        if scope.cancelled_caught:
            raise TimeoutError("no answer in time")

    async def _refresh(self, spec: McpServerSpec, client: Client) -> None:
        tools: list[dict[str, Any]] = []
        skipped: list[str] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            page = await client.list_tools(cursor=cursor)
            for tool in page.tools:
                entry = openai_tool(spec.id, tool.name, tool.description, tool.input_schema)
                if entry is None:
                    skipped.append(tool.name)
                else:
                    tools.append(entry)
            cursor = page.next_cursor
            if cursor is None:
                break
        else:
            log.warning("MCP server %r: tools/list still had more pages after %d; using those", spec.id, MAX_PAGES)
        if self._set_tools(spec.id, tools) and skipped:
            log.warning("MCP server %r: left out tool(s) %s: '%s_NAME' must match ^[A-Za-z0-9_-]{1,64}$ for "
                        "OpenAI clients", spec.id, ", ".join(skipped), spec.id)

    def _set_tools(self, server_id: str, tools: list[dict[str, Any]] | None) -> bool:
        """Record a server's listing (None: unavailable); True when it differs from the previous one."""
        before = self._by_server.get(server_id)
        if tools is None:
            self._by_server.pop(server_id, None)
        else:
            self._by_server[server_id] = tools
        if tools == before:
            return False
        self._tools, dropped = merge_tools((s.id, self._by_server[s.id]) for s in self.servers
                                           if s.id in self._by_server)
        if tools is not None:
            names = ", ".join(t["function"]["name"] for t in tools)
            log.info("MCP server %r offers %d tool(s): %s", server_id, len(tools), names or "none")
        if dropped:
            log.warning("MCP tools with names already taken by an earlier server are left out: %s",
                        ", ".join(dropped))
        return True


@contextlib.asynccontextmanager
async def _connect(spec: McpServerSpec) -> AsyncIterator[Client]:
    """An initialized MCP client session to ``spec`` (a started subprocess, or an HTTP session)."""
    info = Implementation(name="candle-vllm", version=__version__)
    async with contextlib.AsyncExitStack() as stack:
        server: Any
        if spec.command is not None:
            server = StdioServerParameters(command=spec.command, args=list(spec.args), env=spec.env or None,
                                           cwd=spec.cwd)
        else:
            assert spec.url is not None
            http = await stack.enter_async_context(httpx2.AsyncClient(headers=spec.headers, timeout=HTTP_TIMEOUT))
            server = streamable_http_client(spec.url, http_client=http)
        yield await stack.enter_async_context(
            Client(server, cache=None, client_info=info, read_timeout_seconds=CALL_TIMEOUT_S))


def _reason(exc: BaseException) -> str:
    """The innermost causes of an error, one line (the SDK wraps them in nested exception groups)."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_reason(e) for e in exc.exceptions)
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
