"""The streaming core every tool-call format shares: text until a start marker, then a format reader.

Plain text is released at once, except a suffix that may still become a start marker and trailing
whitespace (released with the next visible text; dropped when a call follows it or when the output ends
right after calls). Markers inside Markdown code fences do not count. From a marker on, the format's
:class:`Reader` consumes the text and sends each call's header (id, name) once and its arguments as
fragments that are never taken back. A region the reader rejects -- malformed JSON, unknown tool,
arguments that are not an object, required keys missing, the output ending before a call's header went
out -- is released as text: its marker becomes content and what followed it is scanned again. Only calls of
regions read to the end join :attr:`ToolParser.calls`, with one exception: when the output ends inside a
region (cut by ``max_tokens``) after headers went out, the calls sent so far join ``calls`` with their
arguments as far as they got (as OpenAI returns a cut call), and the rest of the region, never sent, is
dropped, so no text is sent both as a call and as content.

Every decision depends on the text so far, never on how it was cut into pushes, so a stream of deltas
accumulates to exactly what the whole text gives (``push(all) + finish()`` is the whole-text parse). The
one thing a stream cannot undo is a header or fragment sent before its region failed; that call is then
absent from ``calls`` and its text is released as content, as in the whole-text parse.
"""

from __future__ import annotations

import enum
import json
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Protocol

_ID_ALPHABET = string.ascii_letters + string.digits
_WS = " \t\n\r"


@dataclass(slots=True)
class ToolCall:
    """A complete call, as it goes into ``message.tool_calls``; ``arguments`` is the JSON text of an object."""

    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ToolCallDelta:
    """One streamed fragment (``delta.tool_calls[i]``): id and name come once, in a call's first delta."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Status(enum.Enum):
    """What a reader's ``feed`` found."""

    MORE = 0  # needs more text
    DONE = 1  # the region ended; text resumes at the returned position
    FAIL = 2  # the region is not a valid call sequence


class Reader(Protocol):
    """Reads one region after its start marker for one format."""

    def feed(self, text: str, i: int, final: bool) -> tuple[Status, int]:
        """Consume ``text`` from ``i`` (``final``: no more text will come). MORE may leave text unread -- a
        partial literal, or whitespace that may belong to plain text after the calls; if :meth:`end` then
        accepts the region at the end of the output, what is unread goes back to text mode."""
        ...

    def end(self) -> bool:
        """At the end of the output after MORE: whether what was read is a complete region."""
        ...


@dataclass(slots=True)
class OpenCall:
    """A call being read: its header goes out once the name is known; fragments follow."""

    name: str | None = None
    id: str = ""
    index: int | None = None  # set when the header is sent
    arguments: list[str] = field(default_factory=list)


def new_call_id() -> str:
    """``call_`` + 24 random alphanumerics (vLLM's shape; clients only need it unique and >= 9 chars)."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def tool_schemas(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]] | None:
    """``{name: parameters schema}`` of the request's function tools (None: no validation of names)."""
    if tools is None:
        return None
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, dict) else {}
    return out


class ToolParser:
    """Reads tool calls out of one choice's output text, streamed or whole (one instance per choice).

    ``tools`` are the request's tools in OpenAI shape: a call must name one of them, and its arguments must
    be an object holding the schema's ``required`` keys. ``tools=None`` accepts any name (offline parsing).
    Subclasses name their start markers and build the reader of a region.
    """

    start_markers: tuple[str, ...] = ()  # literal markers that start a region anywhere outside code fences
    line_markers: str = ""  # characters that start a region when only whitespace precedes them on their line

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.calls: list[ToolCall] = []
        self._schemas = tool_schemas(tools)
        self._buf = ""  # input not yet decided
        self._out: list[str] = []  # content released by the current push
        self._deltas: list[ToolCallDelta] = []
        self._headers = 0  # headers sent: the next call's index
        self._held_ws = ""
        self._after_call = False  # nothing but whitespace since the last region
        self._line_blank = True  # only whitespace since the last newline
        self._ticks = 0  # length of the backtick run being read
        self._run_blank = False  # that run started a line
        self._fence = 0  # backticks of the open code fence, 0 outside fences
        self._reader: Reader | None = None
        self._region_raw: list[str] = []
        self._region_ws = ""  # whitespace held when the region started
        self._marker_len = 0
        self._region_calls: list[OpenCall] = []
        self._first = frozenset(m[0] for m in self.start_markers) | frozenset(self.line_markers)
        self._plain = re.compile("[^" + re.escape("".join(self._first) + "`" + _WS) + "]+")

    def make_reader(self, marker: str) -> Reader:
        """The reader of a region that starts with ``marker`` (a line marker is also its first character)."""
        raise NotImplementedError

    # -- the public streaming interface ------------------------------------------------------------------

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feed the next piece of output; return the content safe to show now and the call deltas."""
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """End of output: decide what is still held (an unfinished call is released as text)."""
        self._run(final=True)
        if not self._after_call:
            self._out.append(self._held_ws)
        self._held_ws = ""
        return self._take()

    # -- what readers call -------------------------------------------------------------------------------

    def known_tool(self, name: str) -> bool:
        """Whether a call may name ``name``."""
        return self._schemas is None or name in self._schemas

    def open_call(self) -> OpenCall:
        """A new call in the current region."""
        call = OpenCall()
        self._region_calls.append(call)
        return call

    def send_header(self, call: OpenCall) -> None:
        """Send the call's id and name (once)."""
        assert call.name is not None and call.index is None
        call.index, call.id = self._headers, new_call_id()
        self._headers += 1
        self._deltas.append(ToolCallDelta(call.index, call.id, call.name, ""))

    def send_arguments(self, call: OpenCall, text: str) -> None:
        """Send a fragment of the call's arguments (after its header)."""
        assert call.index is not None
        if text:
            call.arguments.append(text)
            last = self._deltas[-1] if self._deltas else None
            if last is not None and last.index == call.index and last.id is None:
                last.arguments += text
            else:
                self._deltas.append(ToolCallDelta(call.index, arguments=text))

    def arguments_valid(self, call: OpenCall) -> bool:
        """The finished arguments are a JSON object with every key the tool's schema requires."""
        try:
            args = json.loads("".join(call.arguments))
        except ValueError:
            return False
        if not isinstance(args, dict):
            return False
        schema = self._schemas.get(call.name or "", {}) if self._schemas is not None else {}
        required = schema.get("required", [])
        return not isinstance(required, list) or all(key in args for key in required)

    def parameter_schema(self, name: str, key: str) -> dict[str, Any] | None:
        """The JSON schema of parameter ``key`` of tool ``name``, when the tools declare one."""
        props = (self._schemas or {}).get(name, {}).get("properties")
        schema = props.get(key) if isinstance(props, dict) else None
        return schema if isinstance(schema, dict) else None

    # -- the driver --------------------------------------------------------------------------------------

    def _take(self) -> tuple[str, list[ToolCallDelta]]:
        text, deltas = "".join(self._out), self._deltas
        self._out, self._deltas = [], []
        return text, deltas

    def _run(self, final: bool) -> None:
        while self._scan_text(final) if self._reader is None else self._feed_region(final):
            pass

    def _feed_region(self, final: bool) -> bool:
        """Advance the open region; True when text mode should run next."""
        assert self._reader is not None
        status, pos = self._reader.feed(self._buf, 0, final)
        self._region_raw.append(self._buf[:pos])
        self._buf = self._buf[pos:]
        if status is Status.MORE:
            if not final:
                return False
            status = Status.DONE if self._reader.end() else Status.FAIL
        # At the end of the output a region fails for want of text (a cut call, a partial closing tag): every
        # other error showed while the text was pushed. Calls already streamed stay calls.
        cut = final and status is Status.FAIL and any(c.index is not None for c in self._region_calls)
        if status is Status.DONE or cut:
            self.calls.extend(ToolCall(c.id, c.name or "", "".join(c.arguments))
                              for c in self._region_calls if c.index is not None)
            self._after_call, self._line_blank = True, False
            if cut:
                self._buf = ""  # what the reader left unread belongs to the cut region
        else:
            raw = "".join(self._region_raw)
            keep = max(self._marker_len, 1)  # the marker (or a line marker's first character) becomes text
            self._release(self._region_ws + raw[:keep])
            self._buf = raw[keep:] + self._buf
        self._reader, self._region_raw, self._region_calls, self._region_ws = None, [], [], ""
        return True

    def _release(self, text: str) -> None:
        """Visible text goes out after the whitespace held before it."""
        self._out.append(self._held_ws)
        self._out.append(text)
        self._held_ws = ""
        self._after_call = self._line_blank = False

    def _scan_text(self, final: bool) -> bool:
        """Release plain text; True when a region started."""
        buf, i = self._buf, 0
        while i < len(buf):
            c = buf[i]
            if c == "`":
                if self._ticks == 0:
                    self._run_blank = self._line_blank
                self._ticks += 1
                self._release(c)
                i += 1
                continue
            if self._ticks:
                self._end_backtick_run()
            if c in _WS:
                self._held_ws += c
                self._line_blank = self._line_blank or c == "\n"
                i += 1
                continue
            if not self._fence and c in self._first:
                marker = self._marker_at(buf, i, final)
                if marker == "":
                    break  # a partial marker: hold it
                if marker is not None:
                    self._open_region(marker, buf, i)
                    return True
            m = self._plain.match(buf, i)
            j = m.end() if m is not None else i + 1
            self._release(buf[i:j])
            i = j
        self._buf = buf[i:]
        return False

    def _marker_at(self, buf: str, i: int, final: bool) -> str | None:
        """The marker starting at ``i``; "" when the text ends inside one."""
        if buf[i] in self.line_markers and self._line_blank:
            return buf[i]
        for marker in self.start_markers:
            if buf.startswith(marker, i):
                return marker
            if not final and len(buf) - i < len(marker) and marker.startswith(buf[i:]):
                return ""
        return None

    def _open_region(self, marker: str, buf: str, i: int) -> None:
        line = marker in self.line_markers and marker not in self.start_markers
        self._marker_len = 0 if line else len(marker)
        self._region_raw = [] if line else [marker]
        self._buf = buf[i + self._marker_len :]
        self._region_ws, self._held_ws = self._held_ws, ""
        self._reader = self.make_reader(marker)

    def _end_backtick_run(self) -> None:
        """A run of 3+ backticks starting a line opens a fence, or closes the open one if long enough."""
        if self._ticks >= 3 and self._run_blank:
            self._fence = 0 if self._fence and self._ticks >= self._fence else self._fence or self._ticks
        self._ticks = 0
