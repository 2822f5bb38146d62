"""``qwen_coder``: the XML call format of Qwen3-Coder and Qwen3.5+.

``<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n...</function>\\n</tool_call>``.
A value is raw text (one leading and one trailing newline dropped), converted by the tool's schema type of
that parameter (:mod:`schema_values`). The header goes out when ``<function=NAME>`` closes; then the
arguments object is built as ``{`` + one ``"key": value`` fragment per finished parameter (joined by
``, ``) + ``}`` at ``</function>``. The closing ``</tool_call>`` may be missing at the end of the output.

Qwen3-Coder sometimes leaves out the ``<tool_call>`` wrapper and writes ``<function=NAME>...</function>``
alone; that bare form is read the same way, one call per region (a stray ``</tool_call>`` right after it
is dropped). A lone ``<function=NAME>`` is weaker evidence than the wrapper, so a bare call's header waits
for its first ``<parameter=`` or ``</function>``.
"""

from __future__ import annotations

import json
from typing import Any

from candle_vllm.api.tool_parsers.base import OpenCall, Reader, Status, ToolParser
from candle_vllm.api.tool_parsers.readers import match_literal, skip_ws
from candle_vllm.api.tool_parsers.schema_values import convert_value

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_MAX_NAME = 256
_FUNC, _NAME, _PARAMS, _KEY, _VALUE, _END = range(6)


def _json(value: Any) -> str:
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):  # a Python literal JSON cannot hold (tuple keys, sets inside)
        return json.dumps(str(value), ensure_ascii=False)


class _XmlReader:
    def __init__(self, owner: ToolParser, bare: bool) -> None:
        self._owner = owner
        self._bare = bare  # the region started at ``<function=`` (its marker already consumed)
        self._state = _NAME if bare else _FUNC
        self._parts: list[str] = []  # the name, key or value being read
        self._tail = ""  # its last len(stop) - 1 characters
        self._call: OpenCall | None = None
        self._key = ""
        self._keys: set[str] = set()

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        while True:
            state = self._state
            if state in (_NAME, _KEY, _VALUE):
                stop = PARAMETER_END if state == _VALUE else ">"
                found, i = self._until(text, i, stop)
                if found is None:
                    return (Status.MORE if state == _VALUE or self._plausible_name() else Status.FAIL), i
                if not self._took(found):
                    return Status.FAIL, i
                continue
            if state == _END and self._bare:
                return self._after_bare(text, i, final)
            i = skip_ws(text, i)
            if i == len(text):
                return Status.MORE, i
            options = {_FUNC: (FUNCTION,), _PARAMS: (PARAMETER, FUNCTION_END), _END: (END,)}[state]
            tag = match_literal(text, i, options, final)
            if not tag:
                return (Status.MORE if tag == "" else Status.FAIL), i
            i += len(tag)
            if state == _PARAMS:
                self._send_header()
            if tag == END:
                return Status.DONE, i
            if tag == FUNCTION_END:
                if not self._close():
                    return Status.FAIL, i
                self._state = _END
            else:
                self._state = _NAME if tag == FUNCTION else _KEY

    def end(self) -> bool:
        return self._state == _END

    def _after_bare(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        """After a bare call's ``</function>``: swallow a ``</tool_call>`` that follows, else end the region
        before the whitespace (which belongs to the text after the call)."""
        j = skip_ws(text, i)
        tag = match_literal(text, j, (END,), final) if j < len(text) else ""
        if tag:
            return Status.DONE, j + len(tag)
        return (Status.MORE if tag == "" else Status.DONE), i

    def _send_header(self) -> None:
        assert self._call is not None
        if self._call.index is None:
            self._owner.send_header(self._call)

    def _until(self, text: str, i: int, stop: str) -> tuple[str | None, int]:
        """Read up to ``stop``: (the text before it, position after it), or (None, end) while it is missing.
        Only the new text and the last few characters before it are searched, so a long value costs O(n)."""
        window = self._tail + text[i:]
        k = window.find(stop)
        if k < 0:
            self._parts.append(text[i:])
            self._tail = window[max(0, len(window) - len(stop) + 1) :]
            return None, len(text)
        prior = "".join(self._parts)
        at = len(prior) - len(self._tail) + k  # where ``stop`` starts in everything read
        found = (prior + text[i:])[:at]
        self._parts, self._tail = [], ""
        return found, i + at + len(stop) - len(prior)

    def _plausible_name(self) -> bool:
        """A function name or parameter key being read is short and on one line."""
        name = "".join(self._parts)
        return len(name) <= _MAX_NAME and "\n" not in name and "<" not in name

    def _took(self, found: str) -> bool:
        """A name, key or value is complete."""
        owner = self._owner
        if self._state == _NAME:
            name = found.strip()
            if not name or not owner.known_tool(name):
                return False
            self._call = owner.open_call()
            self._call.name = name
            if not self._bare:
                owner.send_header(self._call)
            self._state = _PARAMS
            return True
        if self._state == _KEY:
            self._key = found.strip()
            if not self._key or self._key in self._keys:
                return False
            self._keys.add(self._key)
            self._state = _VALUE
            return True
        assert self._call is not None and self._call.name is not None
        raw = found[1:] if found.startswith("\n") else found
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = convert_value(raw, owner.parameter_schema(self._call.name, self._key))
        lead = ", " if len(self._keys) > 1 else "{"
        owner.send_arguments(self._call, f"{lead}{_json(self._key)}: {_json(value)}")
        self._state = _PARAMS
        return True

    def _close(self) -> bool:
        assert self._call is not None
        self._owner.send_arguments(self._call, "}" if self._keys else "{}")
        return self._owner.arguments_valid(self._call)


class QwenCoderParser(ToolParser):
    """Qwen3-Coder XML calls, wrapped in ``<tool_call>`` or bare."""

    start_markers = (START, FUNCTION)

    def make_reader(self, marker: str) -> Reader:
        return _XmlReader(self, bare=marker == FUNCTION)
