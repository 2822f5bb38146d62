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

from candle_vllm.api.chat_output import ChoiceDelta
from candle_vllm.api.errors import APIError, bad_request
from candle_vllm.api.generation import KeepAlive
from candle_vllm.api.responses_input import ResponsesRequest, chat_request, responses_param
from candle_vllm.api.routes.chat import ChatStream, chat_response
from candle_vllm.api.routes.common import get_state, read_json
from candle_vllm.api.schemas import parse_request
from candle_vllm.api.sse import PING, event

bp = Blueprint("responses", __name__)


@bp.post("/v1/responses")
async def responses() -> Any:
    req = parse_request(ResponsesRequest, await read_json())
    response_id = f"resp_{uuid.uuid4().hex}"
    try:
        answer = await chat_response(get_state(), chat_request(req), response_id,
                                     functools.partial(ResponsesStream, responses_req=req))
    except APIError as exc:
        exc.param = responses_param(exc.param)
        raise
    return answer


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

    def body(self, output: list[dict[str, Any]], usage: dict[str, Any] | None,
             finish: str | None = None, done: bool = True) -> dict[str, Any]:
        """The ``response`` object: ``completed``, ``incomplete`` (cut by ``max_output_tokens``) or ``failed``
        (ended by the server, draining), or ``in_progress`` while a stream runs (``done`` false)."""
        req = self.req
        status = "in_progress" if not done else STATUS.get(finish or "", "completed")
        return {
            **self.head, "status": status,
            "error": {"code": "server_error", "message": "the server ended the request (it is shutting down); retry "
                      "on another replica"} if status == "failed" else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "metadata": req.metadata or {},
            "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": req.reasoning, "store": False, "temperature": req.temperature,
            "text": req.text or {"format": {"type": "text"}}, "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [], "top_p": req.top_p, "truncation": req.truncation or "disabled",
            "user": req.user, "usage": usage,
        }

STATUS = {"length": "incomplete", "abort": "failed"}  # a chat finish_reason -> the response's status


def _usage(chat: dict[str, Any]) -> dict[str, Any]:
    details = chat.get("completion_tokens_details") or {}
    cached = chat.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
            "total_tokens": chat["total_tokens"]}


class ResponsesStream(ChatStream):
    """The chat pipeline's deltas of the one choice as Responses events: the reasoning item and the message item
    each opened once, where their first text comes, and filled as it comes; each function call once its arguments
    are whole; every item closed at the end."""

    def __init__(self, *args: Any, responses_req: ResponsesRequest, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.shape = ResponseShape(responses_req, self.base["id"], self.base["model"], self.base["created"])
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # output items so far, in order
        self.text_items: dict[str, int] = {}  # "reasoning" / "message" -> the index of its item
        self.finish: str | None = None
        self.final: dict[str, Any] = {}

    def _event(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\n" + event(payload)

    def _text(self, kind: str, delta: str) -> list[bytes]:
        out = []
        if kind not in self.text_items:
            item = self.shape.reasoning_item("") if kind == "reasoning" else self.shape.message_item("", "")
            self.text_items[kind] = index = len(self.items)
            self.items.append(item)
            out.append(self._event("response.output_item.added", output_index=index,
                                   item={**item, "content": [], "status": "in_progress"}))
            out.append(self._event("response.content_part.added", item_id=item["id"], output_index=index,
                                   content_index=0, part=dict(item["content"][0])))
        index = self.text_items[kind]
        item = self.items[index]
        item["content"][0]["text"] += delta
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
        out.append(self._event(name, item_id=item["id"], output_index=index, content_index=0, delta=delta, **extra))
        return out

    def _delta(self, delta: ChoiceDelta) -> list[bytes]:
        return [*(self._text("reasoning", delta.reasoning) if delta.reasoning else []),
                *(self._text("message", delta.content) if delta.content else [])]

    def _close_texts(self) -> list[bytes]:
        out = []
        status = "completed" if self.finish not in STATUS else "incomplete"
        for kind, index in sorted(self.text_items.items(), key=lambda kv: kv[1]):
            item = self.items[index]
            item["status"] = status
            part, text = item["content"][0], item["content"][0]["text"]
            if kind == "reasoning":
                out.append(self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                                       content_index=0, text=text))
            else:
                out.append(self._event("response.output_text.done", item_id=item["id"], output_index=index,
                                       content_index=0, text=text, logprobs=[]))
            out.append(self._event("response.content_part.done", item_id=item["id"], output_index=index,
                                   content_index=0, part=part))
            out.append(self._event("response.output_item.done", output_index=index, item=item))
        return out

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
            chunks += self._delta(self._step(c))
            if c.finish_reason:
                self.finish = self.choices[0].finish_reason(c.finish_reason)
        return chunks

    async def events(self, head: list[Any], outputs: AsyncIterator[Any]) -> AsyncIterator[bytes]:
        """``response.created`` / ``in_progress``, the items' events, then ``response.completed`` (or
        ``response.incomplete`` / ``response.failed``) with the whole object; no ``[DONE]``, as OpenAI ends
        these streams."""
        start = self.shape.body([], None, done=False)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        async for chunk in self.rendered(head, outputs):
            yield chunk
        choice = self.choices[0]
        if not choice.finished:  # the server ended the request (draining): what the pipeline held still goes out
            self.finish = "abort"
            for chunk in self._delta(choice.finish()):
                yield chunk
        for chunk in [*self._close_texts(), *self._calls_done(choice.message())]:
            yield chunk
        self.final = self.shape.body(self.items, _usage(self._usage()), self.finish)
        yield self._event(f"response.{self.final['status']}", response=self.final)

    def error_events(self, error: APIError) -> list[bytes]:
        """An error after the stream started ends it as ``response.failed``, the items so far included."""
        body = self.shape.body(self.items, None, "abort")
        body["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt", "message": error.message}
        return [self._event("response.failed", response=body)]

    async def whole(self, outputs: AsyncIterator[Any]) -> dict[str, Any]:
        """The non-streamed answer: the object a stream ends with, so both hold the same items in one order."""
        try:
            async for _ in self.events([], outputs):
                pass
        except ValueError as exc:
            raise bad_request(str(exc)) from None  # the engine's admission errors
        return self.final
