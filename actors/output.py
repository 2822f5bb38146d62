"""Output actor: detokenizes and matches stop strings a step behind the scheduler, and fans outputs out to
each request's sink; stop-string hits go back to the scheduler as messages."""

from __future__ import annotations

import trio

from candle_vllm.actors.messages import (
    Deliver,
    Emit,
    OutputInbox,
    Register,
    SchedulerInbox,
    Sink,
    StopStrings,
    send_to_sink,
)
from candle_vllm.pyengine.engine_core import EngineCore
from candle_vllm.pyengine.outputs import RequestOutput


class OutputActor:
    """Owns the per-request sinks."""

    def __init__(self, core: EngineCore, inbox: trio.MemoryReceiveChannel[OutputInbox],
                 scheduler: trio.MemorySendChannel[SchedulerInbox]) -> None:
        self.core = core
        self.inbox = inbox
        self.scheduler = scheduler
        self.sinks: dict[str, Sink] = {}

    async def run(self) -> None:
        async with self.inbox, self.scheduler:
            async for msg in self.inbox:
                if isinstance(msg, Register):
                    self.sinks[msg.request_id] = msg.sink
                elif isinstance(msg, Emit):
                    outputs, hits = self.core.process(msg.step)
                    self._deliver(outputs)
                    if hits:
                        await self.scheduler.send(StopStrings(hits))
                elif isinstance(msg, Deliver):
                    self._deliver(msg.outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self.sinks.get(out.request_id)
            if sink is None:
                continue
            send_to_sink(sink, out)
            if out.finished:
                del self.sinks[out.request_id]
                sink.close()

