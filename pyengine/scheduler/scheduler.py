"""Continuous-batching scheduler: one rule (computed tokens catch up with known tokens under a token budget)
plus policy (decode first, admission and preemption by recompute in request order). No tensors, no model.

Request order is arrival (vLLM's "fcfs" policy) or, under the "priority" policy, the requests' ``priority``
(lower first) then arrival: the queue is kept in that order and the preemption victim is always the last
request in it, so a request never loses its blocks to one that comes after it.

Pipelining choice: ``schedule()`` advances ``num_computed_tokens`` when it plans tokens, so it can plan step
N+1 before ``update()`` has applied step N (the executor one step behind). A request whose sample from
step N is still in flight is planned again with a placeholder token (input id -1 in the plan) that the
runner fills from its own latest sampled ids; stop conditions found late cost one wasted token, which
``update()`` drops. The engine may equally call schedule/update strictly alternately (no placeholders).
Aborts and text stops (``finish``) are applied between steps. Blocks of a request freed while a step that
writes them is in flight are safe to hand out again, because steps run in order on the device.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from candle_vllm.pyengine.kv_cache.block_manager import KVCacheManager
from candle_vllm.pyengine.kv_cache.step_inputs import build_step_arrays
from candle_vllm.pyengine.request import FinishReason, Request, RequestStatus
from candle_vllm.pyengine.scheduler.config import SchedulerConfig
from candle_vllm.pyengine.scheduler.plan import StepPlan

RUNNING = RequestStatus.RUNNING


def _order(req: Request) -> tuple[int, int]:
    """A request's place in request order (its priority is 0 under the fcfs policy)."""
    return req.priority, req.arrival_seq


class RequestRejected(ValueError):
    """The request can never run here (longer than the context, or more KV than the whole cache); a 4xx."""


class _StepLists:
    """Per-request columns of the step being planned."""

    __slots__ = ("counts", "incarnations", "new_ids", "outputs", "preempted", "prompts", "requests", "rows",
                 "sampled", "samples", "starts")

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.rows: list[int] = []
        self.starts: list[int] = []
        self.counts: list[int] = []
        self.incarnations: list[int] = []
        self.prompts: list[list[int]] = []
        self.outputs: list[list[int]] = []
        self.samples: list[bool] = []
        self.sampled: list[Request] = []
        self.new_ids: list[str] = []
        self.preempted: list[str] = []


class Scheduler:
    """Decides, step by step, which requests compute how many tokens, and owns their KV blocks."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.max_num_seqs,
                                 config.max_blocks_per_seq, config.enable_prefix_caching,
                                 config.prefix_cache_max_tokens)
        self.waiting: deque[Request] = deque()
        self.running: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        # Prefix-cache counters at admission (tokens looked up, tokens reused), for metrics.
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self._block_size = config.block_size
        self._budget = config.token_budget
        self._chunk = config.prefill_chunk_size if config.chunked_prefill else self._budget
        self._finished_ids: list[str] = []
        self._resort_running = False

    # ---- requests in and out ----------------------------------------------------------------------------

    def add_request(self, req: Request) -> None:
        """Queue a request (FCFS). Raises ``RequestRejected`` when it could never be scheduled."""
        cfg = self.config
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        n_prompt = req.num_prompt_tokens
        if n_prompt >= cfg.max_model_len:
            raise RequestRejected(
                f"the prompt has {n_prompt} tokens but the model's context is {cfg.max_model_len} tokens "
                f"(prompt plus at least one generated token); shorten the prompt")
        if req.fork_of is not None:
            src = self.requests.get(req.fork_of)
            if src is None or src.prompt_token_ids != req.prompt_token_ids:
                raise ValueError(f"request {req.request_id!r} forks {req.fork_of!r}, which is not a queued "
                                 f"request with the same prompt")
        sp = req.sampling_params
        room = cfg.max_model_len - n_prompt
        req.max_tokens = room if sp.max_tokens is None else min(sp.max_tokens, room)
        kv_tokens = n_prompt + req.max_tokens - 1  # the last sampled token is never fed back
        capacity = cfg.num_blocks * cfg.block_size
        if -(-kv_tokens // cfg.block_size) > cfg.num_blocks:
            raise RequestRejected(
                f"request needs KV cache for {kv_tokens} tokens (prompt {n_prompt} + max_tokens "
                f"{req.max_tokens}) but the whole cache holds {capacity} tokens; raise --kv-fraction or "
                f"--mem, or lower max_tokens")
        if req.priority != 0 and cfg.scheduling_policy != "priority":
            raise RequestRejected(f"priority {req.priority} needs the priority scheduling policy (start the server "
                                  "with --scheduling-policy priority); requests are served first come, first served")
        req.stop_ids = frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else frozenset(req.eos_token_ids))
        req.status = RequestStatus.WAITING
        self.requests[req.request_id] = req
        self._enqueue(req)

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP,
               stop_reason: int | str | None = None) -> Request | None:
        """End a request between steps (a stop string seen by the output processor, or an abort) and free its
        blocks. Returns it, or None when it had already finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, reason, stop_reason)
        return req

    def abort(self, request_id: str) -> Request | None:
        """Cancel a request (client gone); its KV blocks are freed at once."""
        return self.finish(request_id, FinishReason.ABORT)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step ---------------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        """Plan the next step: running requests in arrival order (a prefill chunk leaves budget for every
        running decode), then waiting requests in arrival order while budget, ``max_num_seqs`` and blocks
        allow. Blocks run out: the newest running request not yet planned this step is preempted, so an
        older request never loses its blocks to a newer one."""
        self.step_id += 1
        step = self.step_id
        lists = _StepLists()
        budget = self._budget
        if self._resort_running:
            self.running = dict(sorted(self.running.items(), key=lambda kv: _order(kv[1])))
            self._resort_running = False
        running = list(self.running.values())
        pending_decodes = sum(1 for r in running if r.num_tokens - r.num_computed_tokens <= 1)
        for req in running:
            if budget == 0:
                break
            if req.status is not RUNNING:
                continue
            if req.num_tokens - req.num_computed_tokens <= 1:
                pending_decodes -= 1
                limit = budget
            else:
                limit = budget - pending_decodes
            if limit > 0:
                budget -= self._schedule_running(req, limit, step, lists)
        if not lists.preempted:
            self._admit_waiting(budget, step, lists)

        arrays = build_step_arrays(self.kv.tables, self._block_size, lists.rows, lists.starts, lists.counts,
                                   lists.prompts, lists.outputs, lists.samples)
        finished_ids, self._finished_ids = self._finished_ids, []
        return StepPlan(step, lists.requests, lists.counts, lists.starts, lists.sampled, *arrays,
                        new_request_ids=lists.new_ids, preempted_ids=lists.preempted, finished_ids=finished_ids,
                        incarnations=lists.incarnations)

    def update(self, plan: StepPlan, sampled_token_ids: Sequence[int]) -> list[Request]:
        """Apply a step's sampled ids (plain ints, one per ``plan.sampled_requests``): append them and end
        the requests that hit a stop token (unless ``ignore_eos`` / before ``min_tokens``) or their length
        limit. Returns the requests finished here; results for requests that ended meanwhile are dropped."""
        sampled = plan.sampled_requests
        if len(sampled_token_ids) != len(sampled):
            raise ValueError(f"step {plan.step_id} sampled {len(sampled)} requests, got "
                             f"{len(sampled_token_ids)} token ids")
        for req, start, count, incarnation in zip(plan.requests, plan.start_positions, plan.num_new_tokens,
                                                  plan.incarnations, strict=True):
            if req.status is RUNNING and req.num_preemptions == incarnation:
                req.num_written_tokens = max(req.num_written_tokens, start + count)
        finished: list[Request] = []
        for req, tok in zip(sampled, sampled_token_ids, strict=True):
            req.num_placeholders -= 1
            if req.status is RequestStatus.FINISHED:
                continue
            out = req.output_token_ids
            out.append(tok)
            n_out = len(out)
            if tok in req.stop_ids and n_out >= req.sampling_params.min_tokens:
                self._finish(req, FinishReason.STOP, None if tok in req.eos_token_ids else tok)
            elif n_out >= req.max_tokens:
                self._finish(req, FinishReason.LENGTH, None)
            else:
                continue
            finished.append(req)
        return finished

    # ---- policy helpers ---------------------------------------------------------------------------------

    def _schedule_running(self, req: Request, budget: int, step: int, lists: _StepLists) -> int:
        """Plan the next tokens of a running request, preempting newer ones for blocks; returns tokens."""
        target = req.num_tokens + req.num_placeholders
        if len(req.output_token_ids) + req.num_placeholders >= req.max_tokens:
            return 0  # its last token is in flight; update() will finish it
        num_new = target - req.num_computed_tokens
        if num_new <= 0:
            return 0
        limit = min(budget, self._chunk)
        if num_new > limit:
            if not self.config.chunked_prefill:
                return 0
            num_new = limit
        # Blocks written by completed steps become shareable now.
        self.kv.publish(req.kv_row, req.prompt_token_ids, req.output_token_ids,
                        min(req.num_written_tokens, req.num_tokens))
        while not self.kv.allocate(req.kv_row, req.num_computed_tokens + num_new):
            victim = self._newest_unscheduled(step, req)
            if victim is None:
                self._preempt(req, lists)
                return 0
            self._preempt(victim, lists)
        self._record(req, num_new, step, lists)
        return num_new

    def _admit_waiting(self, budget: int, step: int, lists: _StepLists) -> None:
        skipped: list[Request] = []
        max_seqs = self.config.max_num_seqs
        while self.waiting and budget > 0 and len(self.running) < max_seqs:
            req = self.waiting.popleft()
            got = self._try_admit(req, budget, step, lists)
            if got is None:
                skipped.append(req)
            elif got == 0:
                self.waiting.appendleft(req)
                break
            else:
                budget -= got
        self.waiting.extendleft(reversed(skipped))

    def _try_admit(self, req: Request, budget: int, step: int, lists: _StepLists) -> int | None:
        """Admit ``req`` with its first chunk: tokens planned, 0 when it does not fit now, None when it must
        wait for something else (an in-flight result, or the sibling it forks)."""
        if req.num_placeholders:
            return None
        kv, bs = self.kv, self._block_size
        row = -1
        computed = 0
        if req.fork_of is not None and req.num_preemptions == 0 and req.fork_of in self.requests:
            src = self.requests[req.fork_of]
            shared_blocks = (req.num_prompt_tokens - 1) // bs
            # Only KV written by earlier steps may be shared.
            stable = src.num_computed_tokens - (src.last_step_tokens if src.last_step == step else 0)
            if src.status is not RUNNING or stable < shared_blocks * bs:
                return None
            row = kv.fork_row(src.kv_row, shared_blocks, req.prefix_key)
            computed = shared_blocks * bs
            written = min(computed, src.num_written_tokens)  # the source's blocks, written as far as its are
        else:
            row = kv.open_row(req.prefix_key)
            # Prompt logprobs need every prompt row's logits, which a prefix hit would skip (as in vLLM).
            computed = written = (0 if req.sampling_params.prompt_logprobs is not None else
                                  kv.match_prefix(row, req.prompt_token_ids, req.output_token_ids, req.num_tokens - 1))
        num_new = req.num_tokens - computed
        limit = min(budget, self._chunk)
        if num_new > limit:
            if not self.config.chunked_prefill:
                kv.free_row(row)
                return 0
            num_new = limit
        if not kv.allocate(row, computed + num_new):
            kv.free_row(row)
            return 0
        if req.num_preemptions == 0:
            req.num_cached_tokens = computed
            req.first_scheduled_time = time.monotonic()
        if req.num_preemptions or self.config.scheduling_policy == "priority":
            self._resort_running = True  # running requests go in request order
        self.prefix_queried_tokens += req.num_tokens
        self.prefix_hit_tokens += computed
        req.kv_row = row
        req.num_computed_tokens = computed
        req.num_written_tokens = written
        req.status = RUNNING
        self.running[req.request_id] = req
        lists.new_ids.append(req.request_id)
        self._record(req, num_new, step, lists)
        return num_new

    def _record(self, req: Request, num_new: int, step: int, lists: _StepLists) -> None:
        start = req.num_computed_tokens
        req.num_computed_tokens = start + num_new
        req.last_step = step
        req.last_step_tokens = num_new
        samples = req.num_computed_tokens == req.num_tokens + req.num_placeholders
        lists.requests.append(req)
        lists.rows.append(req.kv_row)
        lists.starts.append(start)
        lists.counts.append(num_new)
        lists.incarnations.append(req.num_preemptions)
        lists.prompts.append(req.prompt_token_ids)
        lists.outputs.append(req.output_token_ids)
        lists.samples.append(samples)
        if samples:
            req.num_placeholders += 1
            lists.sampled.append(req)

    def _newest_unscheduled(self, step: int, req: Request) -> Request | None:
        """The preemption victim for ``req``: the last running request in request order, after ``req``, not
        planned in this step (planned ones are in the plan already)."""
        candidates = [r for r in self.running.values() if r.last_step != step and _order(r) > _order(req)]
        return max(candidates, key=_order, default=None)

    def _enqueue(self, req: Request) -> None:
        """Queue a new or preempted request: last (a new one) or first (a preempted one, older than any waiting)
        in arrival order; in its place by priority under the priority policy."""
        if self.config.scheduling_policy == "priority":
            key = _order(req)
            index = next((i for i, other in enumerate(self.waiting) if _order(other) > key), len(self.waiting))
            self.waiting.insert(index, req)
        elif req.num_preemptions:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def _preempt(self, req: Request, lists: _StepLists) -> None:
        """Free a running request's blocks (publishing its computed full blocks) and queue it first; it
        resumes later by recomputing its prompt and the tokens it generated."""
        self._release_blocks(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = req.num_written_tokens = 0
        req.num_preemptions += 1
        del self.running[req.request_id]
        self._enqueue(req)
        lists.preempted.append(req.request_id)

    def _release_blocks(self, req: Request) -> None:
        self.kv.publish(req.kv_row, req.prompt_token_ids, req.output_token_ids,
                        min(req.num_written_tokens, req.num_tokens))
        self.kv.free_row(req.kv_row)
        req.kv_row = -1

    def _finish(self, req: Request, reason: FinishReason, stop_reason: int | str | None) -> None:
        if req.status is RUNNING:
            self._release_blocks(req)
            del self.running[req.request_id]
        elif req.status is not RequestStatus.FINISHED:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
