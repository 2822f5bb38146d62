"""Readers shared by the JSON-based formats: a call object, a list of them, a bare arguments object.

Each reader feeds its text through :class:`JsonScanner`, so an arguments character goes out only when it
is known to continue valid JSON; arguments are passed through as the model wrote them (never re-encoded),
which makes the streamed fragments add up to exactly the whole-text call.
"""

from __future__ import annotations

from candle_vllm.api.tool_parsers.base import OpenCall, Status, ToolParser
from candle_vllm.api.tool_parsers.json_scan import DONE, ERROR, KEY_END, VALUE_END, VALUE_START, JsonScanner

_WS = " \t\n\r"
ARGUMENT_KEYS = ("arguments", "parameters")


def skip_ws(text: str, i: int) -> int:
    """First position at or after ``i`` that is not JSON whitespace."""
    n = len(text)
    while i < n and text[i] in _WS:
        i += 1
    return i


def match_literal(text: str, i: int, options: tuple[str, ...], final: bool) -> str | None:
    """The option ``text`` holds at ``i``; "" while the text ends inside one (unless ``final``); else None."""
    for option in options:
        if text.startswith(option, i):
            return option
    rest = text[i : i + max(map(len, options))]
    if not final and any(option.startswith(rest) for option in options):
        return ""
    return None


class CallObjectReader:
    """``{"name": "...", "arguments": {...}}`` (or ``"parameters"``), starting at its ``{``.

    The header goes out once the name is known to be a tool and the arguments object has started; the
    arguments then stream through. Other keys, a second name or arguments key, a name that is not a string
    or arguments that are not an object fail the call at once. No arguments at all means ``{}``.
    """

    def __init__(self, owner: ToolParser) -> None:
        self._owner = owner
        self._scan = JsonScanner()
        self._call = owner.open_call()
        self._keys: set[str] = set()
        self._field = ""
        self._in_args = False
        self._early: list[str] = []  # arguments read before the name

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        while True:
            start = i
            flags, i = self._scan.scan(text, i)
            if flags & ERROR:
                return Status.FAIL, i
            if self._in_args:
                self._piece(text[start:i])
                self._in_args = not flags & VALUE_END
            if flags & KEY_END:
                key = self._scan.key or ""
                if key in self._keys or key not in ("name", *ARGUMENT_KEYS) or (
                    key in ARGUMENT_KEYS and self._keys & set(ARGUMENT_KEYS)
                ):
                    return Status.FAIL, i
                self._keys.add(key)
                self._field = key
            if flags & VALUE_START and not self._value_start(text[i - 1]):
                return Status.FAIL, i
            if flags & VALUE_END and self._field == "name" and not self._named(self._scan.string or ""):
                return Status.FAIL, i
            if flags & DONE:
                return (Status.DONE if self._complete() else Status.FAIL), i
            if not flags:
                return Status.MORE, i

    def end(self) -> bool:
        return False

    def _value_start(self, ch: str) -> bool:
        if self._field == "name":
            return ch == '"'
        if ch != "{":
            return False
        self._in_args = True
        self._piece(ch)
        if self._call.name is not None:
            self._header()
        return True

    def _named(self, name: str) -> bool:
        if not self._owner.known_tool(name):
            return False
        self._call.name = name
        if self._in_args or self._early:
            self._header()
        return True

    def _piece(self, text: str) -> None:
        if self._call.index is not None:
            self._owner.send_arguments(self._call, text)
        else:
            self._early.append(text)

    def _header(self) -> None:
        self._owner.send_header(self._call)
        self._owner.send_arguments(self._call, "".join(self._early))
        self._early = []

    def _complete(self) -> bool:
        if self._call.name is None:
            return False
        if self._call.index is None:  # no arguments key
            self._early = ["{}"]
            self._header()
        return self._owner.arguments_valid(self._call)


class SequenceReader:
    """Call objects one after another; subclasses read what lies between them."""

    def __init__(self, owner: ToolParser) -> None:
        self._owner = owner
        self._item: CallObjectReader | None = None
        self._count = 0  # complete call objects

    def _open_item(self) -> None:
        self._item = CallObjectReader(self._owner)

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        while True:
            status: Status | None = None
            if self._item is not None:
                status, i = self._item.feed(text, i, final)
                if status is Status.DONE:
                    self._item, status = None, None
                    self._count += 1
            if status is None:
                status, i = self._between(text, i, final)
            if status is not None:
                return status, i

    def _between(self, text: str, i: int, final: bool) -> tuple[Status | None, int]:
        """Read up to the next call object (opening it) and return None, or end the region with a status."""
        raise NotImplementedError


class ListReader(SequenceReader):
    """``[call, call, ...]`` of :class:`CallObjectReader` objects, starting at its ``[``; at least one call.
    The output may end after the last complete call without the closing ``]``."""

    def __init__(self, owner: ToolParser) -> None:
        super().__init__(owner)
        self._opened = False
        self._after_item = False

    def _between(self, text: str, i: int, final: bool) -> tuple[Status | None, int]:
        n = len(text)
        if not self._opened:
            if i == n:
                return Status.MORE, i
            if text[i] != "[":
                return Status.FAIL, i
            self._opened, i = True, i + 1
        i = skip_ws(text, i)
        if i == n:
            return Status.MORE, i
        ch = text[i]
        if self._after_item:
            if ch == "]":
                return Status.DONE, i + 1
            if ch != ",":
                return Status.FAIL, i
            self._after_item, i = False, skip_ws(text, i + 1)
            if i == n:
                return Status.MORE, i
            ch = text[i]
        if ch != "{":
            return Status.FAIL, i
        self._open_item()
        self._after_item = True
        return None, i

    def end(self) -> bool:
        return self._after_item and self._item is None and self._count > 0


class ArgumentsReader:
    """A bare arguments object for a call whose name is already known (Mistral v11 ``name{...}``): the
    header goes out with its ``{``, the rest streams through."""

    def __init__(self, owner: ToolParser, call: OpenCall) -> None:
        self._owner = owner
        self._call = call
        self._scan = JsonScanner()

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        if i == len(text):
            return Status.MORE, i
        if self._call.index is None:
            i = skip_ws(text, i)
            if i == len(text):
                return Status.MORE, i
            if text[i] != "{":
                return Status.FAIL, i
            self._owner.send_header(self._call)
        start = i
        flags, i = self._scan.scan(text, i)
        while not flags & (DONE | ERROR) and i < len(text):
            flags, i = self._scan.scan(text, i)
        if flags & ERROR:
            return Status.FAIL, i
        self._owner.send_arguments(self._call, text[start:i])
        if flags & DONE:
            return (Status.DONE if self._owner.arguments_valid(self._call) else Status.FAIL), i
        return Status.MORE, i

    def end(self) -> bool:
        return False
