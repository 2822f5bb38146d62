"""A real MCP server for the tests, written with the official SDK (``MCPServer``, the SDK's FastMCP).

``python mcp_demo_server.py stdio`` speaks MCP over stdin/stdout; ``python mcp_demo_server.py http PORT`` serves
streamable HTTP on 127.0.0.1:PORT/mcp with the SDK's own uvicorn runner. With ``MCP_DEMO_PID_FILE`` set, the
process writes its pid there, so a test can kill it. ``MCP_DEMO_EXTRA_TOOL=1`` adds a third tool, so a test can
tell a restarted server from the first one.
"""

from __future__ import annotations

import os
import sys
from typing import Literal

from mcp.server.mcpserver import MCPServer

app = MCPServer("demo", log_level="WARNING")


@app.tool()
def add(a: int, b: int) -> int:
    """Add two integers and return the sum."""
    return a + b


@app.tool()
def get_weather(city: str, unit: Literal["celsius", "fahrenheit"] = "celsius", days: int = 1) -> str:
    """Weather forecast for a city."""
    return f"sunny in {city} for {days} day(s), 21 degrees {unit}"


if os.environ.get("MCP_DEMO_EXTRA_TOOL") == "1":

    @app.tool()
    def echo(text: str) -> str:
        """Repeat the text."""
        return text


if __name__ == "__main__":
    if pid_file := os.environ.get("MCP_DEMO_PID_FILE"):
        with open(pid_file, "w") as f:
            f.write(str(os.getpid()))
    if sys.argv[1] == "http":
        app.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        app.run()
