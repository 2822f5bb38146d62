"""The scheduler's output for one step: a small plan plus flattened arrays ready for the runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from candle_vllm.pyengine.request import Request


@dataclass(slots=True)
class StepPlan:
    """What one model step computes (all sequences flattened into one token batch, vLLM v1 style).

    Per scheduled request ``i`` (batch order): ``requests[i]`` computes ``num_new_tokens[i]`` tokens starting
    at position ``start_positions[i]``; its token rows are ``query_start_loc[i]:query_start_loc[i+1]``.
    ``sampled_requests`` are the requests whose last row is sampled this step, in the order of
    ``sample_indices`` (the rows to take logits from); ``Scheduler.update`` expects one sampled id each, in
    that order. ``input_ids`` holds -1 where a token was sampled by an earlier step whose result had not come
    back when this plan was made (the executor one step behind): the runner substitutes that request's
    latest sampled id. All arrays are copies owned by the plan.

    ``new_request_ids``: admitted this step (fresh or resumed after preemption): the runner (re)builds their
    per-request state. ``preempted_ids`` lost their blocks this step; ``finished_ids`` ended since the
    previous plan: the runner drops their state. ``incarnations[i]`` is ``requests[i].num_preemptions`` when
    planned: the step's KV writes count for that incarnation of the request only.
    """

    step_id: int
    requests: list[Request]
    num_new_tokens: list[int]
    start_positions: list[int]
    sampled_requests: list[Request]
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    block_tables: np.ndarray
    sample_indices: np.ndarray
    new_request_ids: list[str] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    incarnations: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def request_ids(self) -> list[str]:
        return [r.request_id for r in self.requests]

    @property
    def is_empty(self) -> bool:
        """Nothing to run (all requests waiting on in-flight results, or none at all)."""
        return not self.requests
