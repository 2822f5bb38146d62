"""Helpers every route uses: the server state, JSON bodies, model checks, admission and response shapes."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import trio
from quart import Response, current_app, request

from candle_vllm.api import sse
from candle_vllm.api.errors import APIError, bad_request, service_unavailable
from candle_vllm.api.generation import EngineRequest, GenerationBatch, KeepAlive, start_batch
from candle_vllm.api.state import ServerState
from candle_vllm.pyengine.outputs import RequestOutput

STATE_KEY = "candle_vllm"
log = logging.getLogger(__name__)
T = TypeVar("T")


def get_state() -> ServerState:
    return current_app.extensions[STATE_KEY]


async def read_json() -> Any:
    """The request body decoded as JSON; a wrong Content-Type or malformed JSON is a 4xx, never a 500."""
    data = await request.get_data(as_text=False)
    limit = get_state().config.max_body_bytes
    if len(data) > limit:
        raise APIError(413, f"the request body is larger than {limit} bytes")
    ctype = request.headers.get("Content-Type", "application/json").split(";")[0].strip().lower()
    if ctype != "application/json" and not ctype.endswith("+json"):
        raise APIError(415, f"Content-Type must be application/json, got {ctype!r}")
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the request body is not valid JSON: {exc}") from None


def check_model(state: ServerState, model: str | None) -> str:
    """The model name to report; an unknown name is a 404 as OpenAI answers it."""
    if model is None or model in state.model_names:
        return model or state.model_names[0]
    raise APIError(404, f"The model `{model}` does not exist. Available: {', '.join(state.model_names)}",
                   param="model", code="model_not_found")


async def in_worker(state: ServerState, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread: prompt preparation (chat template render, tokenizing a prompt of
    megabytes) takes seconds of CPU, and on the event loop it would stall every other request, /health included.

    ``state.prompt_limiter`` caps the threads, so a flood of such requests queues instead of spawning threads
    without bound. A cancelled caller (client gone, server draining) returns at once; its thread finishes in
    the background (Python threads cannot be stopped) and holds its limiter slot until then."""
    return await trio.to_thread.run_sync(fn, *args, limiter=state.prompt_limiter, abandon_on_cancel=True)


def now_s() -> int:
    return int(time.time())


def admit(state: ServerState) -> None:
    """503 while the server drains or holds ``max_pending_requests`` requests already."""
    if state.draining:
        raise service_unavailable("the server is shutting down; retry on another replica", retry_after_s=5)
    if state.num_active >= state.config.max_pending_requests:
        raise service_unavailable(f"the server is overloaded ({state.num_active} requests in flight); retry later")


async def submit(state: ServerState, requests: list[EngineRequest],
                 stream: bool) -> tuple[GenerationBatch, AsyncIterator[Any], list[Any]]:
    """Admit and start the engine requests of one HTTP request.

    For a stream, waits for the first engine output (or a keep-alive tick) before the 200 is sent, so
    admission errors (e.g. a request that can never fit the KV cache) are still plain HTTP errors. Returns
    the batch, its output iterator, and the items already taken from it.
    """
    admit(state)
    batch = start_batch(state, requests)
    outputs = batch.outputs(state.config.keepalive_s if stream else None)
    head: list[Any] = []
    try:
        if stream:
            head.append(await anext(outputs))
    except StopAsyncIteration:
        pass
    except ValueError as exc:  # the engine's admission errors (EngineRejection)
        await batch.close()
        raise bad_request(str(exc)) from None
    except BaseException:
        await batch.close()
        raise
    return batch, outputs, head


async def collect(outputs: AsyncIterator[Any], n_requests: int) -> list[RequestOutput | None]:
    """The last output of every request (non-streaming responses); ``None`` where none arrived."""
    last: list[RequestOutput | None] = [None] * n_requests
    try:
        async for item in outputs:
            if not isinstance(item, KeepAlive):
                index, out = item
                last[index] = out
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return last


def usage(outs: list[RequestOutput | None], prompt_lens: list[int]) -> dict[str, Any]:
    """OpenAI usage with ``prompt_tokens_details.cached_tokens`` (prefix-cache hits)."""
    prompt = sum(prompt_lens)
    completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def event_stream(batch: GenerationBatch, stream: sse.EventStream, head: list[Any],
                 outputs: AsyncIterator[Any]) -> Response:
    """A ``text/event-stream`` response of ``stream``'s events whose body always releases ``batch``; an error
    after the 200 goes out as ``stream.error_events`` (OpenAI's error event, then ``[DONE]``, for chat)."""

    async def guarded() -> AsyncIterator[bytes]:
        try:
            async for chunk in stream.events(head, outputs):
                yield chunk
        except APIError as exc:
            for chunk in stream.error_events(exc):
                yield chunk
        except ValueError as exc:  # the engine refused the request after all
            for chunk in stream.error_events(bad_request(str(exc))):
                yield chunk
        except Exception as exc:
            log.exception("stream failed after it started")
            for chunk in stream.error_events(APIError(500, f"generation failed: {exc}")):
                yield chunk
        finally:
            await batch.close()

    gen = guarded()
    batch.abort_when_collected(gen)
    response = Response(gen, status=200, headers=sse.HEADERS)
    response.timeout = None  # quart's RESPONSE_TIMEOUT would cut long streams silently
    return response

