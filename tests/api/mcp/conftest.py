"""Real MCP servers for the MCP tests: the demo server (official SDK) as a stdio command or an HTTP process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from candle_vllm.api.mcp.config import McpServerSpec

DEMO = Path(__file__).with_name("mcp_demo_server.py")
DEMO_TOOLS = ("add", "get_weather")


def stdio_spec(server_id: str, pid_file: Path, **env: str) -> McpServerSpec:
    """The demo server as a command our manager starts; it writes its pid to ``pid_file``."""
    return McpServerSpec(server_id, command=sys.executable, args=(str(DEMO), "stdio"),
                         env={"MCP_DEMO_PID_FILE": str(pid_file), **env})


def read_pid(pid_file: Path, timeout_s: float = 20.0, not_pid: int | None = None) -> int:
    """The pid a demo server wrote (waiting for a new one when ``not_pid`` is given)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = pid_file.read_text() if pid_file.exists() else ""
        if text.strip() and int(text) != not_pid:
            return int(text)
        time.sleep(0.05)
    raise TimeoutError(f"no demo server pid in {pid_file}")


def is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class HttpDemo:
    """The demo server over streamable HTTP on loopback, in its own process (startable again on the same port)."""

    def __init__(self, log_file: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/mcp"
        self._log = log_file
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, **env: str) -> HttpDemo:
        with self._log.open("ab") as log:
            self.proc = subprocess.Popen([sys.executable, str(DEMO), "http", str(self.port)], stdout=log,
                                         stderr=subprocess.STDOUT, env={**os.environ, **env})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self._log.read_text()
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"the demo HTTP server did not listen on {self.port}: {self._log.read_text()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)


@pytest.fixture
def http_demo(tmp_path: Path) -> Iterator[HttpDemo]:
    demo = HttpDemo(tmp_path / "http_demo.log").start()
    try:
        yield demo
    finally:
        demo.kill()
