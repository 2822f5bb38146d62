"""``AsyncEngine``: the engine as trio actors (intake, scheduler, executor, output) in one nursery, with the
streaming interface the HTTP layer uses (contract G)."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import trio

from candle_vllm.actors.executor import ExecutorActor
from candle_vllm.actors.intake import IntakeActor
from candle_vllm.actors.messages import (
    Abort,
    Executed,
    ExecutorInbox,
    IntakeInbox,
    OutputInbox,
    SchedulerInbox,
    SinkItem,
    Submit,
)
from candle_vllm.actors.output import OutputActor
from candle_vllm.actors.scheduler import PIPELINE_DEPTH, SchedulerActor
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.outputs import RequestOutput
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.scheduler import RequestRejected

EngineRejection = RequestRejected
INBOX_SIZE = 4096  # queued submissions before the API waits (backpressure)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for /metrics and load shedding."""

    num_running: int
    num_waiting: int
    kv_usage: float
    kv_capacity_tokens: int
    steps: int


class AsyncEngine:
    """Submit requests and stream their outputs; every method runs in the trio thread of the engine's nursery."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.tokenizer = core.tokenizer
        self.model_config = core.model_config
        self.matryoshka = core.matryoshka
        self.max_model_len = core.max_model_len
        self.model_name = core.info.model_name
        self.info = core.info
        self._intake_send, self._intake_recv = trio.open_memory_channel[IntakeInbox](INBOX_SIZE)
        self._sched_send, self._sched_recv = trio.open_memory_channel[SchedulerInbox](INBOX_SIZE)
        exec_send, exec_recv = trio.open_memory_channel[ExecutorInbox](PIPELINE_DEPTH)
        result_send, result_recv = trio.open_memory_channel[Executed](PIPELINE_DEPTH)
        out_send, out_recv = trio.open_memory_channel[OutputInbox](64)
        self._intake = IntakeActor(core, self._intake_recv, self._sched_send.clone())
        self._scheduler = SchedulerActor(core, self._sched_recv, exec_send, result_recv, out_send)
        self._executor = ExecutorActor(core.runner, exec_recv, result_send)
        self._output = OutputActor(core, out_recv, self._sched_send.clone())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run the actors until cancelled; ``nursery.start(engine.run)`` returns once they accept requests."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._executor.run)
            nursery.start_soon(self._output.run)
            nursery.start_soon(self._scheduler.run)
            nursery.start_soon(self._intake.run)
            task_status.started()

    async def generate(self, prompt_token_ids: list[int] | None, params: SamplingParams, request_id: str,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield the request's progress; the last output has ``finished=True``. Raises the rejection (a
        ``ValueError``) before the first output when the request can never run. Leaving early aborts it."""
        sink_send, sink_recv = trio.open_memory_channel[SinkItem](math.inf)
        await self._intake_send.send(Submit(request_id, prompt, prompt_token_ids, params, sink_send, priority))
        finished = False
        try:
            async with sink_recv:
                async for item in sink_recv:
                    if isinstance(item, Exception):
                        finished = True
                        raise item
                    finished = item.finished
                    yield item
                    if finished:
                        return
        finally:
            if not finished:
                with trio.CancelScope(shield=True):
                    await self._intake_send.send(Abort(request_id))

    async def abort(self, request_id: str) -> None:
        """Cancel a request; its stream ends with ``finish_reason="abort"`` if anyone still reads it."""
        await self._intake_send.send(Abort(request_id))

    def stats(self) -> EngineStats:
        sched = self.core.scheduler
        return EngineStats(sched.num_running, sched.num_waiting, sched.kv.usage, self.info.kv_capacity_tokens,
                           self._scheduler.steps)


@asynccontextmanager
async def open_engine(args: EngineArgs) -> AsyncIterator[AsyncEngine]:
    """Load the model (in a worker thread, so the event loop stays responsive), start the actors, and stop
    them when the block exits."""
    core = await trio.to_thread.run_sync(EngineCore, args)
    engine = AsyncEngine(core)
    async with trio.open_nursery() as nursery:
        await nursery.start(engine.run)
        try:
            yield engine
        finally:
            nursery.cancel_scope.cancel()
