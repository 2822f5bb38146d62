"""Tools in a chat request: which tools the prompt offers, how the output is read back as calls, and the
checks of ``tool_choice`` and of the tool-message history.

``tool_choice`` decides the mode: ``none`` offers no tools and parses nothing; ``auto`` lets the model's own
format (read by the model family's parser) carry calls amid text; ``required`` and a named function constrain
the output with a JSON schema (structured output) and read it as that JSON, as vLLM does, so a call is
guaranteed to come back.
"""

from __future__ import annotations

import functools
import logging
import secrets
import string
from dataclasses import dataclass
from typing import Any, Protocol

from candle_vllm.api.errors import bad_request
from candle_vllm.api.schemas import ChatCompletionRequest, ChatMessage, NamedToolChoice
from candle_vllm.api.tool_parsers import ToolCall, ToolCallDelta, make_parser

log = logging.getLogger(__name__)

_ID_ALPHABET = string.ascii_letters + string.digits


class CallReader(Protocol):
    """What reads calls out of output text (contract T's ``ToolParser`` and the constrained-mode readers)."""

    calls: list[ToolCall]

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]: ...

    def finish(self) -> tuple[str, list[ToolCallDelta]]: ...


def new_call_id() -> str:
    """``call_`` + 24 random alphanumerics, the id shape contract T's parsers give."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


class NamedCallReader:
    """``tool_choice`` naming a function: the whole (schema-constrained) output is that call's arguments, so
    the header goes out with the first text and every later piece is an argument fragment."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.id = new_call_id()
        self.calls: list[ToolCall] = []
        self._arguments: list[str] = []

    def push(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        if not text:
            return "", []
        first = not self._arguments
        self._arguments.append(text)
        if first:
            return "", [ToolCallDelta(0, self.id, self.name, text)]
        return "", [ToolCallDelta(0, arguments=text)]

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        deltas = [] if self._arguments else [ToolCallDelta(0, self.id, self.name, "")]
        self.calls = [ToolCall(self.id, self.name, "".join(self._arguments))]
        return "", deltas


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one request handles tools: what the template sees, the output schema, and how to read calls."""

    tools: list[dict[str, Any]] | None  # offered in the prompt
    mode: str  # "none" | "auto" | "required" | "named"
    parser_name: str | None  # contract T parser for "auto"/"required"
    named: str | None = None
    parallel: bool = True

    @property
    def finishes_with_tool_calls(self) -> bool:
        """Whether a choice that made calls ends with ``finish_reason: "tool_calls"``: for ``auto`` and
        ``required``, as OpenAI and vLLM answer; a named ``tool_choice`` ends with ``"stop"`` (the caller forced
        that call, so the reason reports only how the output ended), in stream and whole response alike."""
        return self.mode != "named"

    @property
    def parses(self) -> bool:
        return self.mode == "named" or self.parser_name is not None

    def reader(self) -> CallReader | None:
        """A fresh reader for one choice, or None when the output is plain text."""
        if self.mode == "named":
            assert self.named is not None
            return NamedCallReader(self.named)
        if self.parser_name is None:
            return None
        return make_parser(self.parser_name, self.tools)

    def output_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow (``required``: a list of calls; named: the arguments).

        The call objects built here close with ``additionalProperties: false``: JSON Schema (and the grammar
        compiled from it) allows extra keys by default, and a small model then keeps writing keys such as
        ``"description"`` until ``max_tokens`` instead of closing the call. The tools' own parameter schemas
        are passed through as given, as vLLM does (their authors decide whether extra arguments are allowed).
        """
        if self.mode == "named":
            fn = next(t["function"] for t in self.tools or [] if t["function"]["name"] == self.named)
            return fn.get("parameters") or {"type": "object"}
        if self.mode != "required":
            return None
        variants = [
            {"type": "object",
             "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                            "parameters": t["function"].get("parameters") or {"type": "object"}},
             "required": ["name", "parameters"], "additionalProperties": False}
            for t in self.tools or []
        ]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
        if not self.parallel:
            schema["maxItems"] = 1
        return schema


@functools.cache
def _log_no_parser(model: str) -> None:
    log.warning("no tool-call parser is known for %s: tools go into the prompt, the answer comes back as text "
                "(choose one with --enforce-parser)", model)


def plan_tools(req: ChatCompletionRequest, mcp_tools: list[dict[str, Any]] | None, parser_name: str | None,
               model: str) -> ToolPlan:
    """Resolve ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (400s for impossible choices).

    MCP tools are offered when the request brings none. Without a parser for the model, ``auto`` answers
    text (logged once); ``required``/named need none, since their output shape is fixed by the schema.
    """
    choice = req.tool_choice
    if choice == "none":
        return ToolPlan(None, "none", None)
    tools = req.tool_dicts() or mcp_tools or None
    if choice == "required" and not tools:
        raise bad_request("tool_choice 'required' needs tools; send tools or use tool_choice 'auto'",
                          param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t["function"]["name"] for t in tools or []]
        if choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not among the "
                              f"tools ({', '.join(names) or 'none given'})", param="tool_choice")
        return ToolPlan(tools, "named", None, choice.function.name, req.parallel_tool_calls)
    if not tools:
        return ToolPlan(None, "auto", None)
    if choice == "required":
        return ToolPlan(tools, "required", "json", None, req.parallel_tool_calls)
    if parser_name is None:
        _log_no_parser(model)
    return ToolPlan(tools, "auto", parser_name, None, req.parallel_tool_calls)


def check_tool_history(messages: list[ChatMessage]) -> None:
    """Every assistant tool call is answered by exactly one later ``role: "tool"`` message with its id before
    the next assistant or user turn, and every tool message answers such a call; otherwise a 400 naming the
    id (templates would render a conversation the model was never trained on)."""
    pending: dict[str, int] = {}  # call id -> index of the assistant message that made it
    answered: set[str] = set()
    for i, msg in enumerate(messages):
        if msg.role == "tool":
            call_id = msg.tool_call_id
            if not call_id:
                raise bad_request(f"messages[{i}]: a tool message needs tool_call_id", param="messages")
            if call_id in answered:
                raise bad_request(f"messages[{i}]: tool call {call_id!r} is answered more than once",
                                  param="messages")
            if call_id not in pending:
                raise bad_request(f"messages[{i}]: tool_call_id {call_id!r} answers no tool call of the assistant "
                                  "message before it", param="messages")
            del pending[call_id]
            answered.add(call_id)
            continue
        if msg.role in ("assistant", "user") and pending:
            _unanswered(pending)
        if msg.role == "assistant":
            for j, call in enumerate(msg.tool_calls or []):
                call_id = call.get("id") if isinstance(call, dict) else None
                if not isinstance(call_id, str) or not call_id:
                    raise bad_request(f"messages[{i}].tool_calls[{j}] has no id", param="messages")
                if call_id in pending or call_id in answered:
                    raise bad_request(f"messages[{i}]: tool call id {call_id!r} is used twice", param="messages")
                pending[call_id] = i
    if pending:
        _unanswered(pending)


def _unanswered(pending: dict[str, int]) -> None:
    call_id, index = next(iter(pending.items()))
    raise bad_request(f"tool call {call_id!r} of messages[{index}] has no tool message answering it (add a "
                      f"message with role 'tool' and tool_call_id {call_id!r})", param="messages")
