"""MCP client side of the server: tools of configured MCP servers offered to requests that bring none.

``config`` reads the flags and file (no SDK import, so the CLI checks them cheaply); ``manager`` (imports the
``mcp`` SDK, about a second) keeps the tool list fresh; ``tools`` shapes MCP tools as OpenAI tools.
"""
