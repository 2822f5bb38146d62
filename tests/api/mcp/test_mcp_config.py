"""MCP flags and config file: what is accepted becomes server specs; anything else is one line and exit 2."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from candle_vllm.api import cli
from candle_vllm.api.mcp.config import McpConfigError, McpServerSpec, load_mcp_config, mcp_server_specs

GOOD = {
    "mcpServers": {
        "files": {"command": "npx", "args": ["-y", "@modelcontextprotocol/server-filesystem", "/tmp"],
                  "env": {"DEBUG": "1"}, "cwd": "/tmp", "type": "stdio"},
        "web-search": {"url": "https://mcp.example.com/mcp", "headers": {"Authorization": "Bearer t"},
                       "type": "streamable-http"},
        "old": {"command": "old-server", "disabled": True},
        "plain": {"url": "http://127.0.0.1:9000/mcp"},
    }
}
GOOD_SPECS = [
    McpServerSpec("files", command="npx", args=("-y", "@modelcontextprotocol/server-filesystem", "/tmp"),
                  env={"DEBUG": "1"}, cwd="/tmp"),
    McpServerSpec("web-search", url="https://mcp.example.com/mcp", headers={"Authorization": "Bearer t"}),
    McpServerSpec("plain", url="http://127.0.0.1:9000/mcp"),
]


def write(tmp_path: Path, data: Any) -> Path:
    path = tmp_path / "mcp.json"
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_config_file_becomes_specs_in_file_order(tmp_path: Path) -> None:
    assert load_mcp_config(write(tmp_path, GOOD)) == GOOD_SPECS
    assert [s.transport for s in GOOD_SPECS] == ["stdio", "streamable-http", "streamable-http"]


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], '{"mcpServers"'),
        ({"servers": {}}, '{"mcpServers"'),
        ({"mcpServers": {}}, "mcpServers is empty"),
        ({"mcpServers": {"a.b": {"command": "x"}}}, "mcpServers.a.b: the id must be"),
        ({"mcpServers": {"a": "x"}}, "mcpServers.a: expected an object"),
        ({"mcpServers": {"a": {}}}, "mcpServers.a: give exactly one of 'command'"),
        ({"mcpServers": {"a": {"command": "x", "url": "http://h/mcp"}}}, "give exactly one of"),
        ({"mcpServers": {"a": {"command": "x", "headers": {}}}}, "unsupported key(s) headers"),
        ({"mcpServers": {"a": {"url": "http://h/mcp", "timeout": 5}}}, "unsupported key(s) timeout"),
        ({"mcpServers": {"a": {"url": "http://h/sse", "type": "sse"}}}, "SSE servers are not supported"),
        ({"mcpServers": {"a": {"command": "x", "type": "http"}}}, "type 'http' does not fit a command"),
        ({"mcpServers": {"a": {"command": ""}}}, "mcpServers.a.command: expected a non-empty string"),
        ({"mcpServers": {"a": {"command": "x", "args": "-y pkg"}}}, "mcpServers.a.args: expected a list"),
        ({"mcpServers": {"a": {"command": "x", "env": {"K": 1}}}}, "mcpServers.a.env: expected an object"),
        ({"mcpServers": {"a": {"url": "ftp://h/mcp"}}}, "mcpServers.a.url: expected an http://"),
        ({"mcpServers": {"a": {"url": "http://h/mcp", "headers": ["x"]}}}, "mcpServers.a.headers"),
        ({"mcpServers": {"a": {"command": "x", "disabled": "yes"}}}, "mcpServers.a.disabled"),
    ],
)
def test_bad_config_files_name_the_problem(tmp_path: Path, data: Any, says: str) -> None:
    path = write(tmp_path, data)
    with pytest.raises(McpConfigError) as info:
        load_mcp_config(path)
    text = str(info.value)
    assert text.startswith(f"--mcp-config {path}: ") and says in text and "\n" not in text


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(McpConfigError, match="cannot read the file"):
        load_mcp_config(tmp_path / "absent.json")


def test_command_flags_make_one_server_called_mcp(tmp_path: Path) -> None:
    assert mcp_server_specs(None, "npx", ["-y", "pkg"]) == [McpServerSpec("mcp", command="npx", args=("-y", "pkg"))]
    assert mcp_server_specs(None, None, None) == []
    with pytest.raises(McpConfigError, match="--mcp-args needs --mcp-command"):
        mcp_server_specs(None, None, ["a"])
    with pytest.raises(McpConfigError, match="cannot be combined"):
        mcp_server_specs(str(write(tmp_path, GOOD)), "npx", None)


def test_cli_passes_the_servers_and_refresh_interval_to_the_server_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    def fake_serve(engine_args: Any, server_args: cli.ServerArgs, source: Any) -> int:
        seen["args"] = server_args
        return 0

    monkeypatch.setattr(cli, "serve", fake_serve)
    assert cli.main(["--mcp-config", str(write(tmp_path, GOOD)), "--mcp-refresh-s", "5"]) == 0
    assert (seen["args"].mcp_servers, seen["args"].mcp_refresh_s) == (GOOD_SPECS, 5.0)
    assert cli.main(["--mcp-command", "uvx", "--mcp-args=--from,pkg,server"]) == 0
    assert seen["args"].mcp_servers == [McpServerSpec("mcp", command="uvx", args=("--from", "pkg", "server"))]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--mcp-config", "{dir}/absent.json"], "candle-vllm: --mcp-config {dir}/absent.json: cannot read the file"),
        (["--mcp-args", "a,b"], "candle-vllm: --mcp-args needs --mcp-command"),
        (["--mcp-config", "{dir}/absent.json", "--mcp-command", "x"], "candle-vllm: --mcp-config and --mcp-command"),
    ],
)
def test_cli_refuses_bad_mcp_flags_with_one_line(
    tmp_path: Path, argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main([a.format(dir=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(says.format(dir=tmp_path))


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_refresh_interval_must_be_positive(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main(["--mcp-refresh-s", value])
    assert info.value.code == 2 and "--mcp-refresh-s" in capsys.readouterr().err


def test_console_script_refuses_a_bad_file_before_loading(tmp_path: Path) -> None:
    exe = shutil.which("candle-vllm")
    assert exe is not None, "the candle-vllm console script is not installed (pip install -e .)"
    path = write(tmp_path, {"mcpServers": {"a": {"command": "x", "url": "http://h/mcp"}}})
    done = subprocess.run([exe, "--mcp-config", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"candle-vllm: --mcp-config {path}: mcpServers.a: give exactly one of "
                                        "'command' (stdio) or 'url' (streamable HTTP)"]
