"""``qwen``: the Hermes format of Qwen2.5/Qwen3 (and other Hermes-style models).

``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, several in a row. The closing tag may be
missing at the very end of the output (it is sometimes a stop token).
"""

from __future__ import annotations

from candle_vllm.api.tool_parsers.base import Reader, Status, ToolParser
from candle_vllm.api.tool_parsers.readers import CallObjectReader, match_literal, skip_ws

START, END = "<tool_call>", "</tool_call>"


class _HermesReader:
    def __init__(self, owner: ToolParser) -> None:
        self._owner = owner
        self._object: CallObjectReader | None = None
        self._read = False  # the call object is complete

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        if not self._read:
            if self._object is None:
                i = skip_ws(text, i)
                if i == len(text):
                    return Status.MORE, i
                if text[i] != "{":
                    return Status.FAIL, i
                self._object = CallObjectReader(self._owner)
            status, i = self._object.feed(text, i, final)
            if status is not Status.DONE:
                return status, i
            self._read = True
        i = skip_ws(text, i)
        if i == len(text):
            return Status.MORE, i
        tag = match_literal(text, i, (END,), final)
        if tag is None:
            return Status.FAIL, i
        return (Status.DONE, i + len(tag)) if tag else (Status.MORE, i)

    def end(self) -> bool:
        return self._read


class QwenParser(ToolParser):
    """Hermes ``<tool_call>`` JSON calls."""

    start_markers = (START,)

    def make_reader(self, marker: str) -> Reader:
        return _HermesReader(self)
