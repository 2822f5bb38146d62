"""SSE events stay whole for clients that split lines the way str.splitlines does, as httpx's iter_lines does."""

from __future__ import annotations

import json

import httpx2 as httpx

from candle_vllm.api import sse


def test_generated_line_separators_do_not_split_an_event() -> None:
    text = "a\u2028b\u0085c\u2029d\ne\x1cf \u00e9\U0001f600"
    raw = sse.event({"choices": [{"text": text}]}) + sse.PING + sse.DONE
    lines = [line for line in httpx.Response(200, content=raw).iter_lines() if line]
    assert lines[1:] == [": ping", "data: [DONE]"], lines
    assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["text"] == text
