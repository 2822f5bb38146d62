"""``POST /v1/chat/completions``: render the chat template, run the engine, answer JSON or an SSE stream."""

from __future__ import annotations

import uuid
from typing import Any

from quart import Blueprint

from candle_vllm.api import sse
from candle_vllm.api.generation import EngineRequest, KeepAlive
from candle_vllm.api.logprobs import chat_logprobs
from candle_vllm.api.prompts import check_length, render_chat, sampling_params
from candle_vllm.api.routes.common import (
    check_model,
    collect,
    event_stream,
    get_state,
    now_s,
    read_json,
    submit,
)
from candle_vllm.api.routes.common import usage as usage_of
from candle_vllm.api.schemas import ChatCompletionRequest, parse_request
from candle_vllm.pyengine.outputs import CompletionOutput, RequestOutput

bp = Blueprint("chat", __name__)


@bp.post("/v1/chat/completions")
async def chat_completions() -> Any:
    state = get_state()
    req = parse_request(ChatCompletionRequest, await read_json())
    model = check_model(state, req.model)
    tokenizer = state.engine.tokenizer
    text = render_chat(tokenizer, req)
    ids = tokenizer.encode(text, add_special_tokens=False)
    limit = req.token_limit()
    check_length(len(ids), limit, state.engine.max_model_len)
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, limit, tokenizer.vocab_size, logprobs=top)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    batch, outputs, head = await submit(state, [EngineRequest(request_id, ids, params, text)], req.stream)
    created = now_s()
    if req.stream:
        stream = ChatStream(req, request_id, model, created, len(ids), tokenizer)
        return event_stream(batch, lambda: stream.events(head, outputs))
    try:
        (last,) = await collect(outputs, 1)
    finally:
        await batch.close()
    return _response(req, request_id, model, created, last, len(ids), tokenizer)


def _response(req: ChatCompletionRequest, request_id: str, model: str, created: int, out: RequestOutput | None,
              prompt_len: int, tokenizer: Any) -> dict[str, Any]:
    """The non-streaming ``chat.completion`` object; choices the engine never reported end as ``abort``."""
    by_index = {c.index: c for c in (out.outputs if out else [])}
    choices = []
    for i in range(req.n):
        c = by_index.get(i) or CompletionOutput(index=i)
        logprobs = None
        if req.logprobs:
            logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0, tokenizer)}
        choices.append({"index": i, "message": {"role": "assistant", "content": c.text},
                        "logprobs": logprobs, "finish_reason": c.finish_reason or "abort",
                        "stop_reason": c.stop_reason})
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": choices, "usage": usage_of([out], [prompt_len])}


class ChatStream(sse.EventStream):
    """Turns engine outputs into ``chat.completion.chunk`` events with OpenAI's invariants: the role once per
    choice with its first output, ``finish_reason`` exactly once per choice, optional usage chunk last."""

    def __init__(self, req: ChatCompletionRequest, request_id: str, model: str, created: int, prompt_len: int,
                 tokenizer: Any) -> None:
        self.req = req
        self.base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.prompt_len = prompt_len
        self.tokenizer = tokenizer
        self.role_sent: set[int] = set()
        self.finished: set[int] = set()
        self.last: RequestOutput | None = None

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body: dict[str, Any] = {**self.base, "choices": choices}
        if self.include_usage:
            body["usage"] = usage_of([self.last], [self.prompt_len]) if self.continuous_usage else None
        return sse.event(body)

    def _choice_chunks(self, c: CompletionOutput) -> list[bytes]:
        out = []
        if c.index not in self.role_sent:
            self.role_sent.add(c.index)
            out.append(self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}]))
        if c.index in self.finished:
            return out
        wants_logprobs = self.req.logprobs and c.token_ids_delta
        if not (c.text_delta or wants_logprobs or c.finish_reason):
            return out
        logprobs = None
        if self.req.logprobs:
            logprobs = {"content": chat_logprobs(c.token_ids_delta, c.logprobs_delta or [],
                                                 self.req.top_logprobs or 0, self.tokenizer)}
        delta = {"content": c.text_delta} if c.text_delta else {}
        choice: dict[str, Any] = {"index": c.index, "delta": delta, "logprobs": logprobs,
                                  "finish_reason": c.finish_reason}
        if c.finish_reason:
            self.finished.add(c.index)
            choice["stop_reason"] = c.stop_reason
        out.append(self._chunk([choice]))
        return out

    def _render(self, item: Any) -> list[bytes]:
        if isinstance(item, KeepAlive):
            return [sse.PING]
        _, out = item
        self.last = out
        return [chunk for c in out.outputs for chunk in self._choice_chunks(c)]

    def _abort_unfinished(self) -> list[bytes]:
        return [chunk for i in range(self.req.n) if i not in self.finished
                for chunk in self._choice_chunks(CompletionOutput(index=i, finish_reason="abort"))]

    def _usage(self) -> dict[str, Any]:
        return usage_of([self.last], [self.prompt_len])
