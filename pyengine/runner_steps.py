"""The runner's step records: what a launched step still owes the host (:class:`PendingStep`), what a finished
one produced (:class:`StepResult`), and where each placeholder input of a new step comes from."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from candle_vllm.pyengine.ops.transfer import to_host
from candle_vllm.pyengine.outputs import PromptLogprobsChunk, TokenLogprobs
from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.sampling.logprobs import LogprobsTensors
from candle_vllm.pyengine.scheduler.plan import StepPlan


@dataclass(slots=True)
class StepResult:
    """What one step produced, in ``plan.sampled_requests`` order, plus prompt logprobs of prefill chunks and the
    embeddings of embedding requests whose prompt it completed (request id -> L2-normalised vector)."""

    step_id: int
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    embeddings: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class PipelineStats:
    """Counters that show whether steps really overlap: ``overlapped`` launches found the previous step still
    on the device; ``serialized`` launches had to read pending steps back first (a fallback); ``fed_as_sampled``
    launches took the previous step's sampled ids as their inputs as they are (no copy or gather in between)."""

    launched: int = 0
    overlapped: int = 0
    serialized: int = 0
    fed_as_sampled: int = 0


@dataclass(slots=True, eq=False)
class PendingStep:
    """A launched step: its device work is queued and its sampled ids are on their way to pinned host memory.

    ``ModelRunner.collect`` turns it into ``result`` (or ``error``). Until then ``sampled`` (int64 [B] on the
    device) is what the next step's placeholders gather from, by ``row_of`` (request id -> sampled row)."""

    plan: StepPlan
    sampled: torch.Tensor | None = None
    histories: list[list[int]] = field(default_factory=list)  # each sampled request's token record
    grammar_rows: list[int] = field(default_factory=list)
    logprobs: tuple[LogprobsTensors, list[int | None]] | None = None
    # request id -> (the chunk's first position, logprobs of the prompt tokens it predicts, top-k, rows)
    prompt_logprobs: dict[str, tuple[int, LogprobsTensors | None, int, int]] = field(default_factory=dict)
    # Embedding requests' ids and their vectors (f32 [len(ids), H], one row each)
    embeddings: tuple[list[str], torch.Tensor] | None = None
    result: StepResult | None = None
    error: BaseException | None = None
    row_of: dict[str, int] = field(default_factory=dict)
    _host_ids: torch.Tensor | None = None
    _ready: torch.cuda.Event | None = None

    @property
    def requests(self) -> list[Request]:
        return self.plan.sampled_requests

    def set_sampled(self, sampled: torch.Tensor, histories: list[list[int]]) -> None:
        """Record the step's sampled ids (int64 [B], on the device) and each sampled request's token record."""
        self.sampled = sampled
        self.histories = histories
        self.row_of = {req.request_id: i for i, req in enumerate(self.plan.sampled_requests)}

    def start_read_back(self, device: torch.device) -> None:
        """Queue the copies of all that collect reads (ids, logprobs, embeddings) to pinned host memory, then an
        event."""
        if self.sampled is not None:
            self._host_ids = to_host(self.sampled)
        if self.logprobs is not None:
            self.logprobs = (_logprobs_to_host(self.logprobs[0]), self.logprobs[1])
        self.prompt_logprobs = {
            rid: (start, None if lp is None else _logprobs_to_host(lp), k, n)
            for rid, (start, lp, k, n) in self.prompt_logprobs.items()
        }
        if self.embeddings is not None:
            self.embeddings = (self.embeddings[0], to_host(self.embeddings[1]))
        if device.type == "cuda":
            self._ready = torch.cuda.Event()
            self._ready.record()

    def wait_for_ids(self) -> list[int]:
        """The sampled ids as ints, once the device has produced and copied them (logprobs are then on the host
        too)."""
        if self._ready is not None:
            self._ready.synchronize()
        return [] if self._host_ids is None else self._host_ids.tolist()

    def release(self) -> None:
        """Drop the device tensors once read back (a later step then takes these tokens from the host)."""
        self.sampled = self._host_ids = self._ready = None
        self.logprobs = None
        self.prompt_logprobs = {}
        self.embeddings = None
        self.row_of = {}


def _logprobs_to_host(lp: LogprobsTensors) -> LogprobsTensors:
    return LogprobsTensors(to_host(lp.token_ids), to_host(lp.logprobs), to_host(lp.ranks))


def placeholder_sources(
    plan: StepPlan, sampled: dict[str, list[int]], pending: PendingStep | None
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None] | None:
    """Where the placeholder inputs (-1) of ``plan`` come from: ``(ids, dst, src)`` where ``ids`` has every
    placeholder whose token is already on the host (``sampled``, by request id) filled in, and the others (the
    tokens ``pending``, the last launched step, samples) are to be gathered on the device: ``ids[dst[i]] =
    pending.sampled[src[i]]`` (``dst`` and ``src`` None when there are none). None when some placeholder's
    token is neither on the host nor in ``pending``."""
    holes = np.flatnonzero(plan.input_ids < 0)
    if holes.size == 0:
        return plan.input_ids, None, None
    ids = plan.input_ids.copy()
    rows = np.searchsorted(plan.query_start_loc, holes, side="right") - 1
    in_flight = pending.row_of if pending is not None else {}
    dst: list[int] = []
    src: list[int] = []
    for hole, row in zip(holes.tolist(), rows.tolist(), strict=True):
        req = plan.requests[row]
        history = sampled.get(req.request_id, ())
        k = int(plan.positions[hole]) - req.num_prompt_tokens
        if k < len(history):
            ids[hole] = history[k]
        elif k == len(history) and req.request_id in in_flight:
            ids[hole] = 0
            dst.append(hole)
            src.append(in_flight[req.request_id])
        else:
            return None
    if not dst:
        return ids, None, None
    return ids, np.array(dst, dtype=np.int64), np.array(src, dtype=np.int64)
