"""Scheduler overhead per decode step: N running sequences, time ``schedule()`` + ``update()`` (target < 1 ms
at 256 sequences). The "model" is free: sampled ids come from a precomputed random table.

    python benches/bench_scheduler.py [--seqs 256] [--steps 2000] [--block-size 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.sampling import SamplingParams
from candle_vllm.pyengine.scheduler import Scheduler, SchedulerConfig


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--one-step-behind", action="store_true", help="plan step N+1 before applying step N")
    args = ap.parse_args()

    rng = random.Random(0)
    max_len = args.prompt_len + args.steps + 8
    blocks_per_seq = -(-max_len // args.block_size)
    cfg = SchedulerConfig(num_blocks=args.seqs * blocks_per_seq, block_size=args.block_size,
                          max_model_len=max_len, max_num_seqs=args.seqs,
                          max_num_batched_tokens=args.seqs * args.prompt_len)
    sched = Scheduler(cfg)
    for i in range(args.seqs):
        prompt = [rng.randrange(32000) for _ in range(args.prompt_len)]
        sched.add_request(Request(f"b-{i}", prompt, SamplingParams(max_tokens=args.steps + 4, ignore_eos=True)))
    table = [rng.randrange(32000) for _ in range(4096)]

    def sampled(n: int, k: int) -> list[int]:
        start = (k * 97) % (len(table) - n)
        return table[start:start + n]

    plan = sched.schedule()  # the whole prefill in one step (budget covers it)
    sched.update(plan, sampled(len(plan.sampled_requests), 0))
    times: list[float] = []
    inflight = None
    cpu0 = time.thread_time()
    for k in range(1, args.steps + 1):
        t0 = time.perf_counter()
        plan = sched.schedule()
        if args.one_step_behind:
            if inflight is not None:
                sched.update(*inflight)
            inflight = (plan, sampled(len(plan.sampled_requests), k))
        else:
            sched.update(plan, sampled(len(plan.sampled_requests), k))
        times.append(time.perf_counter() - t0)
        assert len(plan.requests) == args.seqs and plan.num_tokens == args.seqs
    # CPU time of this thread excludes the time other processes held the core (shared CI machines).
    cpu_ms = (time.thread_time() - cpu0) / args.steps * 1e3
    times.sort()
    med, p99 = statistics.median(times), times[int(0.99 * len(times))]
    mode = "one step behind" if args.one_step_behind else "sync"
    print(f"scheduler decode step, {args.seqs} seqs, block {args.block_size}, {mode}: "
          f"wall median {med * 1e3:.3f} ms, p99 {p99 * 1e3:.3f} ms; CPU {cpu_ms:.3f} ms/step "
          f"over {args.steps} steps")


if __name__ == "__main__":
    main()
