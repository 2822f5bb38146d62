"""``llama3``: Llama 3.1/3.2 JSON calls, ``{"name": "f", "parameters": {...}}``.

A call starts a line (in practice the output) or follows ``<|python_tag|>``; several are joined by ``;``.
An ``<|eom_id|>``/``<|eot_id|>`` right after the calls is part of them, not content (they are special
tokens: decode with ``skip_special_tokens=False``). ``"arguments"`` is accepted for ``"parameters"``.
"""

from __future__ import annotations

from candle_vllm.api.tool_parsers.base import Reader, Status, ToolParser
from candle_vllm.api.tool_parsers.readers import SequenceReader, match_literal, skip_ws

PYTHON_TAG = "<|python_tag|>"
_ENDS = ("<|eom_id|>", "<|eot_id|>")


class _LlamaReader(SequenceReader):
    def __init__(self, owner: ToolParser) -> None:
        super().__init__(owner)
        self._joined = False  # a ";" was read after the last call

    def _between(self, text: str, i: int, final: bool) -> tuple[Status | None, int]:
        j = skip_ws(text, i)
        if j == len(text):
            # whitespace after a call stays unread: it may turn out to be plain text's
            return Status.MORE, (i if self._count and not self._joined else j)
        if text[j] == "{" and (self._joined or not self._count):
            self._open_item()
            self._joined = False
            return None, j
        if not self._count or self._joined:
            return Status.FAIL, j
        if text[j] == ";":
            self._joined = True
            return None, j + 1
        end = match_literal(text, j, _ENDS, final)
        if end == "":
            return Status.MORE, i
        return Status.DONE, (j + len(end) if end else i)

    def end(self) -> bool:
        return self._count > 0 and self._item is None


class Llama3Parser(ToolParser):
    """Llama 3.x JSON calls."""

    start_markers = (PYTHON_TAG,)
    line_markers = "{"

    def make_reader(self, marker: str) -> Reader:
        return _LlamaReader(self)
