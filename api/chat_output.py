"""One chat choice's output: text -> reasoning splitter -> tool-call reader -> message parts.

Streamed and whole responses run the very same pipeline over the engine's per-step deltas, so a client that
accumulates the stream gets exactly the non-streamed message: the same content, reasoning, tool calls (ids
included) and finish reason. That holds for outputs cut by ``max_tokens`` too: the tool parsers keep a cut
call whose header went out (``tool_parsers.base``). The one exception is a call whose header was streamed
before its text turned out malformed (a stream cannot take it back); that happens only with ``tool_choice``
``auto``, since ``required`` and named outputs follow a grammar.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from candle_vllm.api.chat_tools import CallReader
from candle_vllm.api.reasoning import ReasoningSplitter
from candle_vllm.api.tool_parsers import ToolCallDelta


@dataclass(slots=True)
class ChoiceDelta:
    """What one step adds to a choice."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: ChoiceDelta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls += other.tool_calls

    def to_json(self) -> dict[str, Any]:
        """The ``delta`` object of a stream chunk: reasoning under both names clients read, tool-call fragments
        of one call merged (id, type and name only on the call's first fragment)."""
        out: dict[str, Any] = {}
        if self.reasoning:
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        if self.content:
            out["content"] = self.content
        merged: dict[int, dict[str, Any]] = {}
        for d in self.tool_calls:
            entry = merged.get(d.index)
            if entry is None:
                entry = merged[d.index] = {"index": d.index, "function": {"arguments": ""}}
            if d.id is not None:
                entry.update(id=d.id, type="function")
            if d.name is not None:
                entry["function"]["name"] = d.name
            entry["function"]["arguments"] += d.arguments
        if merged:
            out["tool_calls"] = list(merged.values())
        return out


class ChoiceOutput:
    """Runs one choice's text through the reasoning split and the call reader, and keeps the totals.

    ``reasoning_tokens`` counts the tokens of steps that started or ended inside reasoning: the markers'
    own tokens count as reasoning. Whitespace-only content is held while calls are read, so a message made
    only of calls has ``content: null`` in the stream and in the whole response alike.
    """

    def __init__(self, splitter: ReasoningSplitter | None, reader: CallReader | None, parallel: bool = True,
                 tool_calls_finish: bool = True) -> None:
        self.splitter = splitter
        self.reader = reader
        self.parallel = parallel
        self.tool_calls_finish = tool_calls_finish  # False: calls end with the engine's reason (named tool_choice)
        self.reasoning_tokens = 0
        self.reasoning = ""
        self.content = ""
        self._blank = ""  # whitespace content held back while reading calls
        self.finished = False

    def push(self, text: str, num_tokens: int) -> ChoiceDelta:
        """Feed one step's text (``num_tokens`` tokens); returns what is safe to send now."""
        if self.splitter is None:
            return self._content(text)
        was = self.splitter.in_reasoning
        reasoning, content = self.splitter.push(text)
        if was or self.splitter.in_reasoning:
            self.reasoning_tokens += num_tokens
        delta = self._content(content)
        delta.reasoning = reasoning
        self.reasoning += reasoning
        return delta

    def finish(self) -> ChoiceDelta:
        """End of output: release what the splitter and the reader held."""
        self.finished = True
        delta = ChoiceDelta()
        if self.splitter is not None:
            reasoning, content = self.splitter.finish()
            delta.reasoning = reasoning
            self.reasoning += reasoning
            delta.extend(self._content(content))
        if self.reader is not None:
            text, calls = self.reader.finish()
            delta.extend(self._released(text, calls, final=True))
        return delta

    def _content(self, text: str) -> ChoiceDelta:
        if self.reader is None:
            self.content += text
            return ChoiceDelta(content=text)
        released, calls = self.reader.push(text)
        return self._released(released, calls, final=False)

    def _released(self, text: str, calls: list[ToolCallDelta], final: bool) -> ChoiceDelta:
        if not self.parallel:
            calls = [d for d in calls if d.index == 0]
        text = self._blank + text
        self._blank = ""
        if not text.strip() and not (final and not self.calls):
            self._blank = text  # may still turn out to be the only content of a calls-only message
            text = ""
        self.content += text
        return ChoiceDelta(content=text, tool_calls=calls)

    @property
    def calls(self) -> list[Any]:
        if self.reader is None:
            return []
        return self.reader.calls[:1] if not self.parallel else list(self.reader.calls)

    def finish_reason(self, engine_reason: str | None) -> str:
        """``tool_calls`` when the model stopped after making calls (unless ``tool_calls_finish`` is off); the
        engine's reason otherwise."""
        if engine_reason == "stop" and self.tool_calls_finish and self.calls:
            return "tool_calls"
        return engine_reason or "abort"

    def message(self) -> dict[str, Any]:
        """The non-streamed ``message`` (call only after :meth:`finish`)."""
        calls = self.calls
        msg: dict[str, Any] = {"role": "assistant", "content": self.content if self.content or not calls else None}
        if self.splitter is not None:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning or None
        if calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                                 for c in calls]
        return msg
