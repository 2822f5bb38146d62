"""Per-request state shared by the scheduler, the runner and the output processor.

A ``Request`` is one sequence being generated (an ``n > 1`` request becomes n of them, see ``fork_of``). It is
plain CPU state: token ids, how many of them have KV in the cache (``num_computed_tokens``), and where the
request is in its life. The scheduler is the only writer of the scheduling fields; the others read them.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

_arrival_counter = itertools.count()


class SamplingLimits(Protocol):
    """The part of ``candle_vllm.pyengine.sampling.SamplingParams`` that scheduling reads (stop rules that need
    no text). Typed structurally so this module does not depend on the sampler."""

    n: int
    max_tokens: int | None
    min_tokens: int
    ignore_eos: bool
    stop_token_ids: list[int]
    prompt_logprobs: int | None


class RequestStatus(enum.Enum):
    """Where a request is: queued (``WAITING``), holding KV blocks (``RUNNING``), sent back to the queue after
    losing its blocks (``PREEMPTED``, resumes by recomputing), or done (``FINISHED``)."""

    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    """Why a request ended, with the OpenAI ``finish_reason`` strings as values."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(eq=False, slots=True, repr=False)
class Request:
    """One sequence: its tokens, sampling limits and scheduling progress.

    ``prefix_key`` is mixed into the root of the prefix-cache hash chain, so requests whose KV differs for the
    same token ids (another LoRA adapter, different image content, a per-user cache salt) never share blocks.
    ``fork_of`` names a sibling with the same prompt (``n > 1``): on first admission this request shares the
    sibling's full prompt blocks by reference count instead of recomputing them.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingLimits
    eos_token_ids: Collection[int] = frozenset()
    prefix_key: int = 0
    fork_of: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    # Tokens whose KV is in the cache or being written by a step already planned.
    num_computed_tokens: int = 0
    # Of those, the tokens whose KV a step that completed wrote (or a prefix hit found): only these are published
    # to the prefix cache, so a step that fails never leaves unwritten blocks there for other requests to reuse.
    num_written_tokens: int = 0
    # Prompt tokens reused from the prefix cache (or a fork) at first admission: usage.cached_tokens.
    num_cached_tokens: int = 0
    # When the scheduler first admitted it (time.monotonic()): the queue- and prefill-time metrics.
    first_scheduled_time: float | None = None
    # Tokens sampled by planned steps whose results have not come back through Scheduler.update yet.
    num_placeholders: int = 0
    num_preemptions: int = 0
    # Set by the scheduler on admission: output cap after the context limit, and the ids that end generation.
    max_tokens: int = 0
    stop_ids: frozenset[int] = frozenset()
    # Scheduler bookkeeping: KV-manager row (-1 = no blocks), last step that scheduled it and how many tokens.
    kv_row: int = -1
    last_step: int = -1
    last_step_tokens: int = 0
    arrival_seq: int = field(default_factory=lambda: next(_arrival_counter))
    # vLLM's request priority (lower runs first) under the "priority" scheduling policy; 0 under "fcfs".
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has an empty prompt; send at least one token")
        if not isinstance(self.prompt_token_ids, list):
            self.prompt_token_ids = list(self.prompt_token_ids)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens}, "
                f"finish={self.finish_reason and self.finish_reason.value})")

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens: prompt plus generated so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids
