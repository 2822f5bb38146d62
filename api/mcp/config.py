"""Which MCP servers to connect to: ``--mcp-config FILE`` or ``--mcp-command CMD --mcp-args a,b``.

The file uses the ``mcpServers`` layout most MCP clients share (Claude Desktop, Cursor, the Rust candle-vllm), so
one file can serve the model and the client that executes the calls. Everything is checked here, before the
model loads, and every problem is one line naming the server and the key, because a typo found after minutes of
loading (or silently dropped) wastes a user's time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_REFRESH_S = 30.0  # --mcp-refresh-s: how often tool lists are re-read and dead servers retried
COMMAND_SERVER_ID = "mcp"  # the id of the one server --mcp-command starts
SERVER_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")  # the id prefixes OpenAI function names (^[A-Za-z0-9_-]{1,64}$)
STDIO_KEYS = frozenset({"command", "args", "env", "cwd", "type", "disabled"})
HTTP_KEYS = frozenset({"url", "headers", "type", "disabled"})
STDIO_TYPES = frozenset({"stdio"})
HTTP_TYPES = frozenset({"http", "streamable-http", "streamable_http", "streamableHttp"})


class McpConfigError(Exception):
    """The MCP flags or config file cannot be used; the message says what to fix (the CLI prints it, exit 2)."""


@dataclass(frozen=True, slots=True)
class McpServerSpec:
    """One MCP server: a command speaking MCP over stdio, or a streamable-HTTP endpoint (exactly one is set)."""

    id: str
    command: str | None = None
    args: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    url: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def transport(self) -> str:
        return "stdio" if self.command is not None else "streamable-http"

    def describe(self) -> str:
        """For logs: the command line or the URL (headers and env may hold secrets, so never them)."""
        target = " ".join([self.command, *self.args]) if self.command is not None else str(self.url)
        return f"{self.id!r} ({self.transport}: {target})"


def mcp_server_specs(config_file: str | None, command: str | None, args: Sequence[str] | None) -> list[McpServerSpec]:
    """The servers the MCP flags ask for (empty when none is given)."""
    if config_file is not None and command is not None:
        raise McpConfigError("--mcp-config and --mcp-command cannot be combined; list the command's server in the "
                             "config file instead")
    if args is not None and command is None:
        raise McpConfigError("--mcp-args needs --mcp-command (the arguments are passed to that command)")
    if command is not None:
        if not command.strip():
            raise McpConfigError("--mcp-command is empty; give the command that starts the MCP server")
        return [McpServerSpec(COMMAND_SERVER_ID, command=command, args=tuple(args or ()))]
    if config_file is not None:
        return load_mcp_config(config_file)
    return []


def load_mcp_config(path: str | Path) -> list[McpServerSpec]:
    """Parse a ``{"mcpServers": {ID: {...}}}`` file; servers marked ``"disabled": true`` are left out."""
    where = f"--mcp-config {path}"
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise McpConfigError(f"{where}: cannot read the file ({exc.strerror or exc})") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise McpConfigError(f"{where}: not valid JSON ({str(exc).splitlines()[0]})") from None
    servers = data.get("mcpServers") if isinstance(data, dict) else None
    if not isinstance(servers, dict):
        raise McpConfigError(f'{where}: expected an object {{"mcpServers": {{ID: {{...}}}}}}')
    if not servers:
        raise McpConfigError(f"{where}: mcpServers is empty; list at least one server or drop the flag")
    specs = [_server_spec(f"{where}: mcpServers.{sid}", sid, entry) for sid, entry in servers.items()]
    return [s for s, entry in zip(specs, servers.values(), strict=True) if not entry.get("disabled", False)]


def _server_spec(where: str, sid: str, entry: Any) -> McpServerSpec:
    if not SERVER_ID_RE.match(sid):
        raise McpConfigError(f"{where}: the id must be 1-32 letters, digits, '_' or '-' (it prefixes tool names "
                             "as ID_TOOLNAME)")
    if not isinstance(entry, dict):
        raise McpConfigError(f"{where}: expected an object with 'command' (stdio) or 'url' (streamable HTTP)")
    if ("command" in entry) == ("url" in entry):
        raise McpConfigError(f"{where}: give exactly one of 'command' (stdio) or 'url' (streamable HTTP)")
    is_stdio = "command" in entry
    allowed, types = (STDIO_KEYS, STDIO_TYPES) if is_stdio else (HTTP_KEYS, HTTP_TYPES)
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise McpConfigError(f"{where}: unsupported key(s) {', '.join(unknown)}; a {'stdio' if is_stdio else 'URL'} "
                             f"server takes {', '.join(sorted(allowed))}")
    kind = entry.get("type")
    if kind is not None and kind not in types:
        raise McpConfigError(f"{where}: type {kind!r} does not fit a {'command' if is_stdio else 'url'} server "
                             f"(use {' or '.join(sorted(types))}; SSE servers are not supported, use streamable "
                             "HTTP)")
    if not isinstance(entry.get("disabled", False), bool):
        raise McpConfigError(f"{where}.disabled: expected true or false")
    if is_stdio:
        command = _string(where, entry, "command")
        args = entry.get("args", [])
        if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
            raise McpConfigError(f"{where}.args: expected a list of strings")
        cwd = _string(where, entry, "cwd") if "cwd" in entry else None
        return McpServerSpec(sid, command=command, args=tuple(args), env=_string_map(where, entry, "env"), cwd=cwd)
    url = _string(where, entry, "url")
    if urlsplit(url).scheme not in ("http", "https") or not urlsplit(url).netloc:
        raise McpConfigError(f"{where}.url: expected an http:// or https:// URL, got {url!r}")
    return McpServerSpec(sid, url=url, headers=_string_map(where, entry, "headers"))


def _string(where: str, entry: dict[str, Any], key: str) -> str:
    value = entry[key]
    if not isinstance(value, str) or not value.strip():
        raise McpConfigError(f"{where}.{key}: expected a non-empty string")
    return value


def _string_map(where: str, entry: dict[str, Any], key: str) -> dict[str, str]:
    value = entry.get(key, {})
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise McpConfigError(f"{where}.{key}: expected an object of string values")
    return dict(value)
