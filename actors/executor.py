"""Executor actor: runs planned steps on its device in a worker thread, so the event loop stays free to
process the previous step's outputs and new requests while the model runs.

It keeps the device busy across steps: a plan is launched (queued on the device) and the step before it is
read back only afterwards, so the device computes step N+1 while the host waits for step N's ids, sends them,
and the scheduler applies them and plans N+2. It holds at most one launched step; a ``Flush`` (the scheduler
has no further plan until a result returns) makes it read that one back."""

from __future__ import annotations

import trio

from candle_vllm.actors.messages import Execute, Executed, ExecutorInbox
from candle_vllm.pyengine.runner import ModelRunner, PendingStep, StepResult
from candle_vllm.pyengine.scheduler.plan import StepPlan

Launched = tuple[StepPlan, PendingStep]


class ExecutorActor:
    """One per device: receives ``Execute``/``Flush``, answers ``Executed`` (results or the error) in plan
    order."""

    def __init__(self, runner: ModelRunner, inbox: trio.MemoryReceiveChannel[ExecutorInbox],
                 results: trio.MemorySendChannel[Executed]) -> None:
        self.runner = runner
        self.inbox = inbox
        self.results = results
        self._thread_limit = trio.CapacityLimiter(1)

    async def run(self) -> None:
        held: Launched | None = None
        async with self.inbox, self.results:
            async for msg in self.inbox:
                plan = msg.plan if isinstance(msg, Execute) else None
                if plan is None and held is None:
                    continue
                launched, collected = await trio.to_thread.run_sync(
                    self._advance, plan, held, limiter=self._thread_limit, abandon_on_cancel=False)
                if held is not None:
                    await self.results.send(_executed(held[0], collected))
                held = None
                if isinstance(launched, BaseException):
                    assert plan is not None
                    await self.results.send(Executed(plan, None, launched))
                elif launched is not None:
                    held = launched

    def _advance(self, plan: StepPlan | None, held: Launched | None
                 ) -> tuple[Launched | Exception | None, StepResult | Exception | None]:
        """In the worker thread: launch ``plan`` (if any), then read back ``held`` (if any). Errors are returned,
        each failing only its own step."""
        launched: Launched | Exception | None = None
        if plan is not None:
            try:
                launched = (plan, self.runner.launch(plan))
            except Exception as exc:
                launched = exc
        collected: StepResult | Exception | None = None
        if held is not None:
            try:
                collected = self.runner.collect(held[1])
            except Exception as exc:
                collected = exc
        return launched, collected


def _executed(plan: StepPlan, outcome: StepResult | Exception | None) -> Executed:
    if isinstance(outcome, Exception):
        return Executed(plan, None, outcome)
    assert outcome is not None
    return Executed(plan, outcome)
