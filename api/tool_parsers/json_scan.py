"""An incremental JSON syntax checker, so call arguments can be streamed as the model writes them.

A streamed argument character can never be taken back, so each one is sent only once the text up to it is
known to be a valid prefix of one JSON value. The scanner is a pushdown automaton over the JSON grammar
(RFC 8259, as strict as ``json.loads``: no raw control characters in strings, no leading zeros, no trailing
commas). It also reports the structure one level down -- keys and value boundaries of the top-level object
-- which is all a tool-call reader needs to find ``name`` and ``arguments`` without a second parse.
"""

from __future__ import annotations

import json
import re

# scan() event flags
ERROR = 1
KEY_END = 2  # a key of the top-level object ended; its text is in .key
VALUE_START = 4  # a value one level down started; it starts with the last consumed character
VALUE_END = 8  # a value one level down ended (a number: with the character after it)
DONE = 16  # the top-level value is complete

_WS = " \t\n\r"
_STRING_RUN = re.compile(r'[^"\\\x00-\x1f]+')
_HEX = frozenset("0123456789abcdefABCDEF")
_ESCAPES = frozenset('"\\/bfnrtu')
_LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
_DIGITS = frozenset("0123456789")

# parser states
_VALUE, _FIRST_VALUE, _KEY, _FIRST_KEY, _COLON, _AFTER, _STRING, _ESCAPE, _UNICODE, _NUMBER, _LITERAL, _END = range(12)
# number sub-states; the ones in _NUMBER_ENDS may end the number
_N_MINUS, _N_ZERO, _N_INT, _N_DOT, _N_FRAC, _N_E, _N_ESIGN, _N_EXP = range(8)
_NUMBER_ENDS = frozenset((_N_ZERO, _N_INT, _N_FRAC, _N_EXP))


def _number_step(state: int, ch: str) -> int | None:
    """Next number sub-state, or None when ``ch`` cannot continue the number."""
    digit = ch in _DIGITS
    if state == _N_MINUS:
        return _N_ZERO if ch == "0" else _N_INT if digit else None
    if state in (_N_ZERO, _N_INT):
        if digit:
            return _N_INT if state == _N_INT else None
        return _N_DOT if ch == "." else _N_E if ch in "eE" else None
    if state in (_N_DOT, _N_FRAC):
        return _N_FRAC if digit else (_N_E if ch in "eE" and state == _N_FRAC else None)
    if state == _N_E:
        return _N_ESIGN if ch in "+-" else _N_EXP if digit else None
    return _N_EXP if digit else None  # _N_ESIGN, _N_EXP


class JsonScanner:
    """Feeds one JSON value through, piece by piece, stopping at every structural event a caller may need."""

    def __init__(self) -> None:
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = _VALUE
        self._in_key = False
        self._sub = 0  # number sub-state, or hex digits left in a \\u escape
        self._literal = ""  # characters a true/false/null literal still needs
        self._raw: list[str] | None = None  # text of a string one level down (keys and values)
        self.key: str | None = None  # the last key of the top-level object
        self.string: str | None = None  # the last string value one level down

    @property
    def done(self) -> bool:
        return self._state == _END

    def scan(self, text: str, i: int) -> tuple[int, int]:
        """Consume ``text`` from ``i`` up to and including the first event; return (flags, next position).

        Flags are 0 when the text ran out without an event; one character may raise several (``1}`` ends a
        number and its object). After ERROR the scanner must not be used again.
        """
        n = len(text)
        while i < n:
            state = self._state
            if state == _STRING:
                m = _STRING_RUN.match(text, i)
                if m is not None:
                    if self._raw is not None:
                        self._raw.append(m.group())
                    i = m.end()
                    continue
            flags = self._step(text[i])
            i += 1
            if flags:
                return flags, i
        return 0, i

    def _step(self, ch: str) -> int:
        state = self._state
        if state == _STRING:
            return self._string_char(ch)
        if state == _ESCAPE:
            if ch not in _ESCAPES:
                return ERROR
            self._record(ch)
            if ch == "u":
                self._state, self._sub = _UNICODE, 4
            else:
                self._state = _STRING
            return 0
        if state == _UNICODE:
            if ch not in _HEX:
                return ERROR
            self._record(ch)
            self._sub -= 1
            if self._sub == 0:
                self._state = _STRING
            return 0
        if state == _NUMBER:
            nxt = _number_step(self._sub, ch)
            if nxt is not None:
                self._sub = nxt
                return 0
            if self._sub not in _NUMBER_ENDS:
                return ERROR
            return self._value_done() | self._step(ch)  # ``ch`` ended the number and is read on its own too
        if state == _LITERAL:
            if ch != self._literal[0]:
                return ERROR
            self._literal = self._literal[1:]
            return 0 if self._literal else self._value_done()
        if ch in _WS:
            return 0 if state != _END else ERROR
        if state in (_VALUE, _FIRST_VALUE):
            if ch == "]" and state == _FIRST_VALUE:
                return self._close("[")
            return self._value_start(ch)
        if state in (_KEY, _FIRST_KEY):
            if ch == "}" and state == _FIRST_KEY:
                return self._close("{")
            if ch != '"':
                return ERROR
            self._state, self._in_key = _STRING, True
            self._raw = [] if len(self._stack) == 1 else None
            return 0
        if state == _COLON:
            if ch != ":":
                return ERROR
            self._state = _VALUE
            return 0
        if state == _AFTER:
            if ch == ",":
                self._state = _KEY if self._stack[-1] == "{" else _VALUE
                return 0
            return self._close("{" if ch == "}" else "[" if ch == "]" else "")
        return ERROR  # _END: nothing may follow the value

    def _record(self, ch: str) -> None:
        if self._raw is not None:
            self._raw.append(ch)

    def _string_char(self, ch: str) -> int:
        if ch == "\\":
            self._record(ch)
            self._state = _ESCAPE
            return 0
        if ch != '"':
            return ERROR  # a raw control character (the fast path in scan() took every other one)
        raw = self._raw
        self._raw = None
        if self._in_key:
            self._in_key = False
            self._state = _COLON
            if raw is None:
                return 0
            self.key = json.loads('"' + "".join(raw) + '"')
            return KEY_END
        if raw is not None:
            self.string = json.loads('"' + "".join(raw) + '"')
        return self._value_done()

    def _value_start(self, ch: str) -> int:
        child = VALUE_START if len(self._stack) == 1 else 0
        if ch in "{[":
            self._stack.append(ch)
            self._state = _FIRST_KEY if ch == "{" else _FIRST_VALUE
        elif ch == '"':
            self._state, self._in_key = _STRING, False
            self._raw = [] if child else None
        elif ch == "-" or ch in _DIGITS:
            self._state = _NUMBER
            self._sub = _N_MINUS if ch == "-" else _N_ZERO if ch == "0" else _N_INT
        elif ch in _LITERALS:
            self._state, self._literal = _LITERAL, _LITERALS[ch]
        else:
            return ERROR
        return child

    def _close(self, opener: str) -> int:
        if not self._stack or self._stack[-1] != opener:
            return ERROR
        self._stack.pop()
        return self._value_done()

    def _value_done(self) -> int:
        depth = len(self._stack)
        if depth == 0:
            self._state = _END
            return DONE
        self._state = _AFTER
        return VALUE_END if depth == 1 else 0
