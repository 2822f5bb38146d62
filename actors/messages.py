"""Typed messages between the actors (DESIGN.md data flow). Channels are bounded except the per-request output
sinks: one slow client must never stall the engine loop, so its sink is unbounded and holds small deltas."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TypeAlias

import trio

from candle_vllm.pyengine.engine_core import StepEvents
from candle_vllm.pyengine.output_processor import StopStringHit
from candle_vllm.pyengine.outputs import RequestOutput
from candle_vllm.pyengine.runner import StepResult
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.scheduler.plan import StepPlan

# What a request's sink carries: progress, or the exception that rejected it.
SinkItem: TypeAlias = RequestOutput | Exception
Sink = trio.MemorySendChannel[SinkItem]


def send_to_sink(sink: Sink, item: SinkItem) -> None:
    """Hand an item to a request's reader without waiting; a reader that left is no error (its Abort follows)."""
    with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
        sink.send_nowait(item)


def reject(msg: Submit, error: Exception) -> None:
    """End a request that can never run: its reader gets the error (intake or scheduler, before registration)."""
    send_to_sink(msg.sink, error)
    msg.sink.close()


@dataclass(slots=True)
class Submit:
    """A new user request (API -> intake -> scheduler). ``prompt_token_ids`` None: intake tokenizes ``prompt``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    params: SamplingParams
    sink: Sink
    priority: int = 0  # vLLM's request priority (the priority scheduling policy)


@dataclass(slots=True)
class Abort:
    """Cancel a request (client gone, or shutdown); applied between steps, frees its KV blocks. Clients send it
    through the intake, behind their Submit, so it never reaches the scheduler before the request does."""

    request_id: str


@dataclass(slots=True)
class StopStrings:
    """Engine requests the output actor ended on a stop string (output -> scheduler)."""

    hits: list[StopStringHit]


SchedulerInbox = Submit | Abort | StopStrings
IntakeInbox = Submit | Abort


@dataclass(slots=True)
class Execute:
    """One step for the executor (scheduler -> executor)."""

    plan: StepPlan


@dataclass(slots=True)
class Flush:
    """No plan follows until a result comes back: the executor reads back the step it holds launched
    (scheduler -> executor). Without it the executor keeps its newest step on the device and waits for the
    next plan to launch behind it."""


ExecutorInbox = Execute | Flush


@dataclass(slots=True)
class Executed:
    """The step's results, or the error it raised (executor -> scheduler)."""

    plan: StepPlan
    result: StepResult | None
    error: BaseException | None = None


@dataclass(slots=True)
class Emit:
    """Token events of a step to turn into outputs (scheduler -> output)."""

    step: StepEvents


@dataclass(slots=True)
class Deliver:
    """Finished outputs made outside a step, e.g. aborts (scheduler -> output)."""

    outputs: list[RequestOutput]


@dataclass(slots=True)
class Register:
    """Route a request's outputs to its sink (scheduler -> output, before the request's first step)."""

    request_id: str
    sink: Sink


OutputInbox = Emit | Deliver | Register
