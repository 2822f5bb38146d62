"""Server-sent events framing for OpenAI streams: ``data: <json>\\n\\n`` events, ``: ping`` keep-alive
comments (which the SDK and benchmark clients skip) and the ``data: [DONE]`` terminator."""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

DONE = b"data: [DONE]\n\n"
PING = b": ping\n\n"
HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # reverse proxies must not buffer the stream
}


def event(payload: dict[str, Any]) -> bytes:
    """One SSE event carrying ``payload`` as compact JSON."""
    return b"data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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

    async def events(self, head: list[Any], outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """All SSE events of the stream, ending with ``[DONE]``."""
        for item in head:
            for chunk in self._render(item):
                yield chunk
        async for item in outputs:
            for chunk in self._render(item):
                yield chunk
        for chunk in self._abort_unfinished():  # the server ended requests (draining): every choice finishes
            yield chunk
        if self.include_usage:
            yield event({**self.base, "choices": [], "usage": self._usage()})
        yield DONE
