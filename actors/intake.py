"""Intake actor: validates and tokenizes new requests off the scheduler's path, then queues them for it."""

from __future__ import annotations

import trio

from candle_vllm.actors.messages import Abort, IntakeInbox, SchedulerInbox, reject
from candle_vllm.pyengine.engine_core import EngineCore


class IntakeActor:
    """Resolves sampling defaults and limits, tokenizes text prompts; rejects invalid requests on their sink."""

    def __init__(self, core: EngineCore, inbox: trio.MemoryReceiveChannel[IntakeInbox],
                 scheduler: trio.MemorySendChannel[SchedulerInbox]) -> None:
        self.core = core
        self.inbox = inbox
        self.scheduler = scheduler

    async def run(self) -> None:
        async with self.inbox, self.scheduler:
            async for msg in self.inbox:
                if isinstance(msg, Abort):  # in order behind the request's Submit
                    await self.scheduler.send(msg)
                    continue
                try:
                    if msg.prompt_token_ids is None:
                        if msg.prompt is None:
                            raise ValueError("a request needs a prompt or prompt token ids")
                        msg.prompt_token_ids = self.core.tokenizer.encode(msg.prompt)
                    msg.prompt_token_ids, msg.params = self.core.prepare(msg.prompt_token_ids, msg.params)
                except ValueError as exc:
                    reject(msg, exc)
                    continue
                await self.scheduler.send(msg)
