"""``POST /v1/responses``: OpenAI's Responses API over the chat pipeline (``api/responses_input.py`` reads the
request as a chat request). The answer is a ``response`` object whose ``output`` holds a reasoning item (models
that think), a message item and the function calls; a stream sends the Responses events (``response.created``,
``response.output_item.added``, ``response.output_text.delta``... ``response.completed``), each as ``event:`` +
``data:`` with a ``sequence_number``, built from the same pipeline so the final object equals the whole answer.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint

from candle_vllm.api.generation import KeepAlive
from candle_vllm.api.responses_input import ResponsesRequest, chat_request
from candle_vllm.api.routes.chat import ChatStream, chat_response
from candle_vllm.api.routes.common import get_state, read_json
from candle_vllm.api.schemas import parse_request
from candle_vllm.api.sse import PING, event

bp = Blueprint("responses", __name__)


@bp.post("/v1/responses")
async def responses() -> Any:
    req = parse_request(ResponsesRequest, await read_json())
    response_id = f"resp_{uuid.uuid4().hex}"
    answer = await chat_response(get_state(), chat_request(req), response_id,
                                 functools.partial(ResponsesStream, responses_req=req))
    if req.stream:
        return answer
    choice = answer["choices"][0]
    return ResponseShape(req, response_id, answer["model"], answer["created"]).whole(
        choice["message"], choice["finish_reason"], answer["usage"])


class ResponseShape:
    """The ``response`` object and its items; item ids are fixed at the start so a stream's events and its final
    object name the same items."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str, created: int) -> None:
        self.req = req
        self.head = {"id": response_id, "object": "response", "created_at": created, "model": model}
        self.reasoning_id = f"rs_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {"type": "reasoning", "id": self.reasoning_id, "summary": [],
                "content": [{"type": "reasoning_text", "text": text}], "status": "completed"}

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        return {"type": "message", "id": self.message_id, "role": "assistant", "status": status,
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}

    @staticmethod
    def call_item(call_id: str, name: str, arguments: str) -> dict[str, Any]:
        return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                "arguments": arguments, "status": "completed"}

    def output(self, message: dict[str, Any], finish: str | None) -> list[dict[str, Any]]:
        items = []
        if message.get("reasoning"):
            items.append(self.reasoning_item(message["reasoning"]))
        if message.get("content"):
            items.append(self.message_item(message["content"], "incomplete" if finish == "length" else "completed"))
        for call in message.get("tool_calls") or []:
            items.append(self.call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
        return items

    def body(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             finish: str | None = None) -> dict[str, Any]:
        req = self.req
        return {
            **self.head, "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "output": output, "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": None,
            "reasoning": req.reasoning, "store": False, "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": req.top_p, "truncation": req.truncation or "disabled",
            "user": req.user, "usage": usage,
        }

    def whole(self, message: dict[str, Any], finish: str | None, chat_usage: dict[str, Any]) -> dict[str, Any]:
        status = "incomplete" if finish == "length" else "completed"
        return self.body(status, self.output(message, finish), _usage(chat_usage, message), finish)


def _usage(chat: dict[str, Any], message: dict[str, Any]) -> dict[str, Any]:
    details = chat.get("completion_tokens_details") or {}
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


class ResponsesStream(ChatStream):
    """The chat pipeline's deltas of the one choice as Responses events: reasoning and message text as they come,
    each function call once its arguments are whole."""

    def __init__(self, *args: Any, responses_req: ResponsesRequest, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shape = ResponseShape(responses_req, self.base["id"], self.base["model"], self.base["created"])
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items so far, in order
        self.open: str | None = None  # the item receiving text: "reasoning" or "message"
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its item while arguments arrive
        self.finish: str | None = None

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + event(payload)

    def _open(self, kind: str) -> list[bytes]:
        if self.open == kind:
            return []
        out = self._close()
        self.open = kind
        item = self.shape.reasoning_item("") if kind == "reasoning" else self.shape.message_item("", "")
        item["status"] = "in_progress"
        self.items.append(item)
        out.append(self._event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        out.append(self._event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                               content_index=0, part=dict(item["content"][0])))
        return out

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out = self._open(kind)
        item = self.items[-1]
        item["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(name, item_id=item["id"], output_index=len(self.items) - 1, content_index=0,
                               delta=delta, **extra))
        return out

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        item, index = self.items[-1], len(self.items) - 1
        text = item["content"][0]["text"]
        done = "response.reasoning_text.done" if self.open == "reasoning" else "response.output_text.done"
        item["status"] = "incomplete" if self.open == "message" and self.finish == "length" else "completed"
        self.open = None
        return [self._event(done, item_id=item["id"], output_index=index, content_index=0, text=text),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=item["content"][0]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _calls_done(self, message: dict[str, Any]) -> list[bytes]:
        out = []
        for call in message.get("tool_calls") or []:
            item = self.shape.call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
            self.items.append(item)
            index = len(self.items) - 1
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**item, "arguments": "", "status": "in_progress"}))
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                   delta=item["arguments"]))
            out.append(self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                   name=item["name"], arguments=item["arguments"]))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

    def _render(self, item: Any) -> list[bytes]:
        if isinstance(item, KeepAlive):
            return [PING]
        _, out = item
        self.last = out
        chunks: list[bytes] = []
        for c in out.outputs:
            if self.choices[0].finished:
                continue
            delta = self._step(c)
            if c.finish_reason:
                self.finish = self.choices[0].finish_reason(c.finish_reason)
            if delta.reasoning:
                chunks += self._text("reasoning", delta.reasoning)
            if delta.content:
                chunks += self._text("message", delta.content)
        return chunks

    async def events(self, head: list[Any], outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """``response.created`` / ``in_progress``, the items' events, then ``response.completed`` (or
        ``response.incomplete``) with the whole object; no ``[DONE]``, as OpenAI ends these streams."""
        start = self.shape.body("in_progress", [], None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        async for chunk in self.rendered(head, outputs):
            yield chunk
        choice = self.choices[0]
        if not choice.finished:  # the server ended the request (draining)
            choice.finish()
            self.finish = "abort"
        for chunk in self._close():
            yield chunk
        message = choice.message()
        for chunk in self._calls_done(message):
            yield chunk
        usage = _usage(self._usage(), message)
        status = "incomplete" if self.finish in ("length", "abort") else "completed"
        final = self.shape.body(status, self.items, usage, self.finish)
        yield self._event(f"response.{status}", response=final)
