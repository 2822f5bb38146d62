"""Scheduler actor: the engine's step loop. It keeps the executor one step ahead: while step N runs, step N+1
is already planned and queued (its inputs that step N samples are placeholders the runner fills on the
device), so the device never waits for the event loop. When it cannot plan ahead (every request waits on an
in-flight result) it sends ``Flush`` so the executor reads back the step it holds. Between plans it applies new requests, aborts and stop-string hits;
when a step's result comes back it applies the sampled tokens and passes the token events to the output
actor, which detokenizes them while the next steps run."""

from __future__ import annotations

import logging
from collections import deque

import trio

from candle_vllm.actors.messages import (
    Abort,
    Deliver,
    Emit,
    Execute,
    Executed,
    ExecutorInbox,
    Flush,
    OutputInbox,
    Register,
    SchedulerInbox,
    StopStrings,
    Submit,
    reject,
)
from candle_vllm.pyengine.engine_core import PIPELINE_DEPTH, EngineCore

log = logging.getLogger(__name__)


class SchedulerActor:
    """Owns the scheduler and the KV bookkeeping; the only task that mutates them."""

    def __init__(self, core: EngineCore, inbox: trio.MemoryReceiveChannel[SchedulerInbox],
                 executor: trio.MemorySendChannel[ExecutorInbox], results: trio.MemoryReceiveChannel[Executed],
                 output: trio.MemorySendChannel[OutputInbox]) -> None:
        self.core = core
        self.inbox = inbox
        self.executor = executor
        self.results = results
        self.output = output
        self.steps = 0

    async def run(self) -> None:
        in_flight: deque[Execute] = deque()
        # Requests that ended since the last plan the executor got: an empty plan is not sent, so its finished ids
        # ride on the next one (the runner drops their sampling and grammar state when it sees them).
        finished: list[str] = []
        async with self.inbox, self.executor, self.results, self.output:
            while True:
                await self._apply_pending()
                while len(in_flight) < PIPELINE_DEPTH and self.core.scheduler.has_unfinished_requests():
                    plan = self.core.schedule()
                    finished += plan.finished_ids
                    if plan.is_empty:  # every request waits on an in-flight result
                        break
                    plan.finished_ids, finished = finished, []
                    msg = Execute(plan)
                    await self.executor.send(msg)
                    in_flight.append(msg)
                if not in_flight:
                    await self._handle(await self.inbox.receive())
                    continue
                if len(in_flight) < PIPELINE_DEPTH:  # no plan will follow the executor's newest before a result
                    await self.executor.send(Flush())
                done = await self.results.receive()
                in_flight.popleft()
                if done.error is not None:
                    await self._fail_step(done)
                    continue
                assert done.result is not None
                self.steps += 1
                await self.output.send(Emit(self.core.apply(done.plan, done.result)))

    async def _apply_pending(self) -> None:
        while True:
            try:
                msg = self.inbox.receive_nowait()
            except trio.WouldBlock:
                return
            await self._handle(msg)

    async def _handle(self, msg: SchedulerInbox) -> None:
        core = self.core
        if isinstance(msg, Submit):
            try:
                assert msg.prompt_token_ids is not None
                core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.prompt, msg.priority)
            except ValueError as exc:  # refused before any state changed: a live request with its id keeps its sink
                reject(msg, exc)
                return
            # Registered before this handler returns, so ahead of every step that carries the request.
            await self.output.send(Register(msg.request_id, msg.sink))
        elif isinstance(msg, Abort):
            final = core.abort(msg.request_id)
            if final is not None:
                await self.output.send(Deliver([final]))
        elif isinstance(msg, StopStrings):
            core.finish_stop(msg.hits)

    async def _fail_step(self, done: Executed) -> None:
        """A step raised: its requests are aborted with the error logged, so none hangs and the engine lives."""
        log.error("step %d failed: %r; aborting its requests", done.plan.step_id, done.error, exc_info=done.error)
        groups = {self.core.outputs.group_id(req.request_id) for req in done.plan.requests}
        finals = [out for gid in groups if gid is not None and (out := self.core.abort(gid)) is not None]
        await self.output.send(Deliver(finals))
