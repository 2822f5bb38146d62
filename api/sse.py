"""Server-sent events framing for OpenAI streams: ``data: <json>\\n\\n`` events, ``: ping`` keep-alive
comments (which the SDK and benchmark clients skip) and the ``data: [DONE]`` terminator."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from candle_vllm.api.errors import APIError

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies must not buffer the stream
}


# Characters JSON allows raw inside strings that str.splitlines -- and so httpx's iter_lines/aiter_lines, which
# many clients read SSE with -- takes for line ends, although SSE ends lines only at CR and LF: a generated U+2028
# would cut such a client's event in two mid-JSON. Sent as \u escapes, the same JSON value.
_LINE_BREAKS_IN_STRINGS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON on one line for every line splitter."""
    text = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_IN_STRINGS)
    return b"data: " + text.encode() + b"\n\n"


class EventStream(ABC):
    """The shape every OpenAI stream shares: render each engine output as chunks, finish (``abort``) the choices
    the server ended early, the optional usage chunk, then ``[DONE]``. Chat and completions fill in the parts."""

    base: dict[str, Any]
    include_usage: bool

    @abstractmethod
    def _render(self, item: Any) -> list[bytes]:
        """Chunks for one item of the generation stream (an engine output or a keep-alive)."""

    @abstractmethod
    def _abort_unfinished(self) -> list[bytes]:
        """Chunks that give every choice without a finish_reason ``finish_reason: "abort"``."""

    @abstractmethod
    def _usage(self) -> dict[str, Any]:
        """The request's usage object so far."""

    def error_events(self, error: APIError) -> list[bytes]:
        """An error after the stream started (an ``APIError``): its OpenAI error body as an event, then
        ``[DONE]``."""
        return [event(error.body()), DONE]

    async def rendered(self, head: list[Any], outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """The chunks of every item of the generation stream: those already taken (``head``), then the rest."""
        for item in head:
            for chunk in self._render(item):
                yield chunk
        async for item in outputs:
            for chunk in self._render(item):
                yield chunk

    async def events(self, head: list[Any], outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """All SSE events of the stream, ending with ``[DONE]``."""
        async for chunk in self.rendered(head, outputs):
            yield chunk
        for chunk in self._abort_unfinished():  # the server ended requests (draining): every choice finishes
            yield chunk
        if self.include_usage:
            yield event({**self.base, "choices": [], "usage": self._usage()})
        yield DONE
