"""Engine requests as the HTTP layer drives them.

Each engine ``generate`` iterator is pumped by a task in the server's nursery into one channel per HTTP
request (a completions request with a list of prompts runs several engine requests into the same channel).
Handlers read that channel with a timeout, so an idle stream sends keep-alive comments without cancelling
the engine's iterator mid-step; the server can end every request at once when it drains; and a client
disconnect (the handler is cancelled) still aborts the engine requests and frees their KV blocks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import trio

from candle_vllm.api.metrics import RequestTracker
from candle_vllm.pyengine.outputs import RequestOutput

if TYPE_CHECKING:
    from candle_vllm.api.state import ServerState

log = logging.getLogger(__name__)


class KeepAlive:
    """Yielded by :meth:`GenerationBatch.outputs` when nothing arrived within the keep-alive interval."""


KEEPALIVE = KeepAlive()


@dataclass(slots=True, frozen=True)
class EngineRequest:
    """One engine request of an HTTP request."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    prompt: str | None = None
    priority: int = 0


@dataclass(slots=True)
class _Failed:
    error: Exception


@dataclass(slots=True)
class _Ended:
    index: int
    finished: bool


class GenerationBatch:
    """The engine requests of one HTTP request, running in the background.

    Iterate :meth:`outputs`; always :meth:`close` it (or hand it to :meth:`abort_when_collected`).
    """

    def __init__(self, state: ServerState, requests: list[EngineRequest]) -> None:
        self.state = state
        self.requests = requests
        self.aborted: set[int] = set()  # indices the server ended before the engine finished them
        self._send, self._recv = trio.open_memory_channel[Any](math.inf)
        self._scopes = [trio.CancelScope() for _ in requests]
        self._running = len(requests)
        self._all_done = trio.Event()

    async def _pump(self, index: int) -> None:
        req = self.requests[index]
        engine = self.state.engine
        tracker = RequestTracker(self.state.metrics)
        latest: RequestOutput | None = None
        finished = False
        try:
            with self._scopes[index]:
                try:
                    stream = engine.generate(req.prompt_token_ids, req.params, req.request_id, prompt=req.prompt,
                                             priority=req.priority)
                    async with aclosing(stream):
                        async for out in stream:
                            latest = out
                            tracker.observe(out)
                            self._send.send_nowait((index, out))
                            if out.finished:
                                finished = True
                                break
                except Exception as exc:  # admission errors and engine failures go to the handler
                    finished = True
                    self._send.send_nowait(_Failed(exc))
            if not finished:
                tracker.finish(latest, "abort")
        finally:
            if not finished:
                with trio.CancelScope(shield=True):
                    try:
                        await engine.abort(req.request_id)
                    except Exception:
                        log.exception("aborting request %s failed", req.request_id)
            self._send.send_nowait(_Ended(index, finished))
            self._running -= 1
            if self._running == 0:
                self._send.close()
                self._all_done.set()
                self.state.forget(self)

    async def outputs(self, keepalive_s: float | None = None) -> AsyncIterator[tuple[int, RequestOutput] | KeepAlive]:
        """Yield ``(request index, output)`` as outputs come, and KEEPALIVE after ``keepalive_s`` idle seconds.

        Ends once every request finished or was aborted by the server (see :attr:`aborted`); engine errors are
        re-raised here.
        """
        while True:
            if keepalive_s is None:
                item = await self._next()
            else:
                with trio.move_on_after(keepalive_s) as idle:
                    item = await self._next()
                if idle.cancelled_caught:
                    yield KEEPALIVE
                    continue
            if item is None:
                return
            if isinstance(item, _Failed):
                raise item.error
            if isinstance(item, _Ended):
                if not item.finished:
                    self.aborted.add(item.index)
                continue
            yield item

    async def _next(self) -> Any:
        try:
            return await self._recv.receive()
        except trio.EndOfChannel:
            return None

    def abort(self) -> None:
        """End the requests now (server draining); :meth:`outputs` then ends with :attr:`aborted` filled."""
        for scope in self._scopes:
            scope.cancel()

    async def close(self) -> None:
        """Abort the engine requests that did not finish, and wait until the pumps have let go of them."""
        self.abort()
        with trio.CancelScope(shield=True):
            await self._all_done.wait()
        self._recv.close()

    def abort_when_collected(self, owner: object) -> None:
        """Abort the requests once ``owner`` (a response body) is garbage collected.

        A response body that the server never started to send (the client left between the handler's return
        and the first byte) runs no ``finally``; this makes sure its requests still end.
        """
        token = trio.lowlevel.current_trio_token()

        def _abort() -> None:
            with contextlib.suppress(trio.RunFinishedError):
                token.run_sync_soon(self.abort)

        weakref.finalize(owner, _abort)


def start_batch(state: ServerState, requests: list[EngineRequest]) -> GenerationBatch:
    """Submit requests to the engine in the background; the caller must ``close()`` the result."""
    batch = GenerationBatch(state, requests)
    state.track(batch)
    for i, req in enumerate(requests):
        state.nursery.start_soon(batch._pump, i, name=f"generate {req.request_id}")
    return batch
