"""MCP tool descriptions as the OpenAI ``tools`` entries a chat template renders.

The name is ``ID_TOOLNAME`` (as the Rust candle-vllm names them) so tools of different servers cannot clash and
a client holding the same MCP config knows which server to send a call to. OpenAI clients reject function names
outside ``^[A-Za-z0-9_-]{1,64}$``, so a tool whose prefixed name does not fit is left out (and logged), never
renamed: a renamed tool could not be mapped back to the server's tool by the client that executes it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

FUNCTION_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def function_name(server_id: str, tool_name: str) -> str:
    return f"{server_id}_{tool_name}"


def openai_tool(server_id: str, name: str, description: str | None, input_schema: dict[str, Any] | None
                ) -> dict[str, Any] | None:
    """One OpenAI function tool, or None when the prefixed name is not a valid OpenAI function name."""
    full = function_name(server_id, name)
    if not FUNCTION_NAME_RE.match(full):
        return None
    return {"type": "function", "function": {"name": full, "description": description or "",
                                             "parameters": input_schema or dict(EMPTY_PARAMETERS)}}


def merge_tools(per_server: Iterable[tuple[str, list[dict[str, Any]]]]) -> tuple[list[dict[str, Any]], list[str]]:
    """All servers' tools in config order; a name seen before (``a_b`` + ``c`` vs ``a`` + ``b_c``) keeps its
    first owner. Returns the tools and the dropped duplicates as ``"NAME (server ID)"``."""
    seen: set[str] = set()
    merged: list[dict[str, Any]] = []
    dropped: list[str] = []
    for server_id, tools in per_server:
        for tool in tools:
            name = tool["function"]["name"]
            if name in seen:
                dropped.append(f"{name} (server {server_id!r})")
                continue
            seen.add(name)
            merged.append(tool)
    return merged, dropped
