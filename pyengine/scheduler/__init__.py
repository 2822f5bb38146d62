"""Scheduling policy (contract F): which requests compute how many tokens each step. No tensors, no model.

config.py     SchedulerConfig: token budget, chunk size, max_num_seqs, prefix-cache switches
plan.py       StepPlan: one step's scheduled requests plus flattened arrays for the runner
scheduler.py  Scheduler: admission, chunked prefill, decode-first budget, preemption by recompute, stops
"""

from candle_vllm.pyengine.scheduler.config import SchedulerConfig
from candle_vllm.pyengine.scheduler.plan import StepPlan
from candle_vllm.pyengine.scheduler.scheduler import RequestRejected, Scheduler

__all__ = ["RequestRejected", "Scheduler", "SchedulerConfig", "StepPlan"]
