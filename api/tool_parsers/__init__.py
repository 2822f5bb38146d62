"""Tool-call parsers: read a model's tool calls out of its output text, streamed or whole.

One parser per choice (``make_parser``); ``push`` each piece of output, ``finish`` at the end. Content that
cannot be part of a call is released at once; calls come back as deltas (id and name once, then argument
fragments) and, once read to the end and validated against the request's tools, in ``parser.calls``.
Formats: ``qwen`` (Hermes JSON in ``<tool_call>``), ``qwen_coder`` (XML), ``json`` (bare JSON),
``mistral`` (``[TOOL_CALLS]``, both tokenizer generations), ``llama3`` (JSON, ``<|python_tag|>``).
"""

from __future__ import annotations

from typing import Any

from candle_vllm.api.tool_parsers.base import ToolCall, ToolCallDelta, ToolParser
from candle_vllm.api.tool_parsers.defaults import default_parser_name
from candle_vllm.api.tool_parsers.json_calls import JsonParser
from candle_vllm.api.tool_parsers.llama3 import Llama3Parser
from candle_vllm.api.tool_parsers.mistral import MistralParser
from candle_vllm.api.tool_parsers.qwen import QwenParser
from candle_vllm.api.tool_parsers.qwen_coder import QwenCoderParser

_PARSERS: dict[str, type[ToolParser]] = {
    "qwen": QwenParser,
    "qwen_coder": QwenCoderParser,
    "json": JsonParser,
    "mistral": MistralParser,
    "llama3": Llama3Parser,
}
PARSER_NAMES: tuple[str, ...] = tuple(_PARSERS)

__all__ = [
    "PARSER_NAMES",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "default_parser_name",
    "make_parser",
    "parse_tool_calls",
]


def make_parser(name: str, tools: list[dict[str, Any]] | None) -> ToolParser:
    """A fresh parser of format ``name`` for one choice of a request offering ``tools``."""
    try:
        cls = _PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(PARSER_NAMES)}") from None
    return cls(tools)


def parse_tool_calls(name: str, text: str, tools: list[dict[str, Any]] | None) -> tuple[str, list[ToolCall]]:
    """Whole-text parse: (content, calls) exactly as streaming the same text would give."""
    parser = make_parser(name, tools)
    content, _ = parser.push(text)
    rest, _ = parser.finish()
    return content + rest, parser.calls
