"""Server-sent events framing for OpenAI streams: ``data: <json>\\n\\n`` events, ``: ping`` keep-alive
comments (which the SDK and benchmark clients skip) and the ``data: [DONE]`` terminator."""

from __future__ import annotations

import json
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
