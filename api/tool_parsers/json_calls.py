"""``json``: a bare JSON call object or list of them (Gemma, and the output of ``tool_choice: required``).

``{"name": "f", "arguments": {...}}`` or ``[{"name": ..., "parameters": {...}}, ...]`` starting a line
(usually the output). Any other JSON at a line start is released as text as soon as it stops looking like a
call (the first key that is not ``name``/``arguments``/``parameters``, or a name that is not a tool).
"""

from __future__ import annotations

from candle_vllm.api.tool_parsers.base import Reader, ToolParser
from candle_vllm.api.tool_parsers.readers import CallObjectReader, ListReader


class JsonParser(ToolParser):
    """Bare JSON calls."""

    line_markers = "{["

    def make_reader(self, marker: str) -> Reader:
        return CallObjectReader(self) if marker == "{" else ListReader(self)
