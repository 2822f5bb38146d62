"""``mistral``: ``[TOOL_CALLS]`` followed by a JSON list (tokenizers before v11) or by ``name{...}`` (v11+).

Pre-v11: ``[TOOL_CALLS] [{"name": "add", "arguments": {"a": 1}}, ...]``. v11+: ``[TOOL_CALLS]add{"a": 1}``
per call, shown as ``[TOOL_CALLS]add[ARGS]{"a": 1}`` when the ``[ARGS]`` special token is decoded;
newer tokenizers may put ``[CALL_ID]id`` before ``[ARGS]`` (the id is ours, not the model's). The tags are
special tokens, so the text must be decoded with ``skip_special_tokens=False``.
"""

from __future__ import annotations

import re

from candle_vllm.api.tool_parsers.base import OpenCall, Reader, Status, ToolParser
from candle_vllm.api.tool_parsers.readers import ArgumentsReader, ListReader, match_literal, skip_ws

START, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME_CHARS = re.compile(r"[A-Za-z0-9_.\-]*")
_CALL_ID_CHARS = re.compile(r"[A-Za-z0-9_\-]*")
_MAX_NAME = 256


def _run_end(chars: re.Pattern[str], text: str, start: int) -> int:
    """End of the run of ``chars`` (a pattern that also matches the empty string) at ``start``."""
    run = chars.match(text, start)
    return start if run is None else run.end()
_LIST, _NAME, _TAG, _ID, _ID_TAG = range(5)


class _MistralReader:
    def __init__(self, owner: ToolParser) -> None:
        self._owner = owner
        self._inner: ListReader | ArgumentsReader | None = None
        self._state = _LIST
        self._name = ""

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        n = len(text)
        while self._inner is None:
            state = self._state
            if state == _LIST:
                i = skip_ws(text, i)
                if i == n:
                    return Status.MORE, i
                if text[i] == "[":
                    self._inner = ListReader(self._owner)
                    break
                self._state = state = _NAME
            if state in (_NAME, _ID):
                j = _run_end(_NAME_CHARS if state == _NAME else _CALL_ID_CHARS, text, i)
                if state == _NAME:
                    self._name += text[i:j]
                i = j
                if i == n or len(self._name) > _MAX_NAME or not self._name:
                    return (Status.MORE if i == n and len(self._name) <= _MAX_NAME else Status.FAIL), i
                self._state = state = _TAG if state == _NAME else _ID_TAG
            tag: str | None
            if state == _TAG and text[i] == "{":
                tag = ARGS
            else:
                tag = match_literal(text, i, (ARGS, CALL_ID) if state == _TAG else (ARGS,), final)
                if not tag:
                    return (Status.MORE if tag == "" else Status.FAIL), i
                i += len(tag)
            if tag == CALL_ID:
                self._state = _ID
            elif not self._owner.known_tool(self._name):
                return Status.FAIL, i
            else:
                call: OpenCall = self._owner.open_call()
                call.name = self._name
                self._inner = ArgumentsReader(self._owner, call)
        return self._inner.feed(text, i, final)

    def end(self) -> bool:
        return self._inner is not None and self._inner.end()


class MistralParser(ToolParser):
    """Mistral ``[TOOL_CALLS]`` calls, both tokenizer generations."""

    start_markers = (START,)

    def make_reader(self, marker: str) -> Reader:
        return _MistralReader(self)
