"""Executor actor: runs planned steps on its device in a worker thread, so the event loop stays free to
process the previous step's outputs and new requests while the model runs."""

from __future__ import annotations

import trio

from candle_vllm.actors.messages import Execute, Executed
from candle_vllm.pyengine.runner import ModelRunner


class ExecutorActor:
    """One per device: receives ``Execute``, answers ``Executed`` (results or the error) in order."""

    def __init__(self, runner: ModelRunner, inbox: trio.MemoryReceiveChannel[Execute],
                 results: trio.MemorySendChannel[Executed]) -> None:
        self.runner = runner
        self.inbox = inbox
        self.results = results
        self._thread_limit = trio.CapacityLimiter(1)

    async def run(self) -> None:
        async with self.inbox, self.results:
            async for msg in self.inbox:
                try:
                    result = await trio.to_thread.run_sync(self.runner.execute, msg.plan,
                                                           limiter=self._thread_limit, abandon_on_cancel=False)
                except Exception as exc:  # reported to the scheduler, which fails the step's requests
                    await self.results.send(Executed(msg.plan, None, exc))
                    continue
                await self.results.send(Executed(msg.plan, result))
