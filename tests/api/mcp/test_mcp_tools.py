"""MCP tools as OpenAI tools: ``ID_TOOLNAME``, names OpenAI clients accept, clashes between servers."""

from __future__ import annotations

import jsonschema
import pydantic
from openai.types.chat import ChatCompletionFunctionToolParam

from candle_vllm.api.mcp.tools import merge_tools, openai_tool

OPENAI_TOOL = pydantic.TypeAdapter(ChatCompletionFunctionToolParam)
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}


def test_tool_carries_name_description_and_schema() -> None:
    tool = openai_tool("fs", "read_file", "Read a file.", SCHEMA)
    assert tool == {"type": "function",
                    "function": {"name": "fs_read_file", "description": "Read a file.", "parameters": SCHEMA}}
    OPENAI_TOOL.validate_python(tool)


def test_missing_description_and_schema_become_valid_empties() -> None:
    tool = openai_tool("fs", "ping", None, None)
    assert tool is not None
    OPENAI_TOOL.validate_python(tool)
    jsonschema.Draft202012Validator.check_schema(tool["function"]["parameters"])
    assert jsonschema.Draft202012Validator(tool["function"]["parameters"]).is_valid({})
    assert tool["function"]["description"] == ""


def test_names_openai_would_reject_are_left_out() -> None:
    assert openai_tool("fs", "read.file", "d", SCHEMA) is None
    assert openai_tool("fs", "x" * 62, "d", SCHEMA) is None  # 65 characters with the prefix
    assert openai_tool("fs", "x" * 61, "d", SCHEMA) is not None  # exactly 64


def test_first_server_keeps_a_clashing_name() -> None:
    ab_c = openai_tool("a_b", "c", "from a_b", SCHEMA)
    a_bc = openai_tool("a", "b_c", "from a", SCHEMA)
    other = openai_tool("a", "d", "d", SCHEMA)
    assert ab_c is not None and a_bc is not None and other is not None
    merged, dropped = merge_tools([("a_b", [ab_c]), ("a", [a_bc, other])])
    assert merged == [ab_c, other]
    assert dropped == ["a_b_c (server 'a')"]
