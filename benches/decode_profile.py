"""Where a decode step's GPU time goes, from a torch-profiler trace of ``LLM.generate`` (used by bench_decode.py).

Why a module of its own: with programmatic dependent launches a kernel starts while the one before it still
runs, so per-kernel durations overlap and do not add up to the step. These reports read the trace the way the
step experiences it: idle gaps between kernels, and how far each kernel pushes the end of the work done so far
(its share of the critical path). Under the profiler the launches overlap far less than in an unprofiled CUDA-graph
replay, so the shares rank kernels but overstate every hop between them (on the H200 a RoPE hop the report put at
63 us per step measured 8 us when removed): size a change with an unprofiled A/B or an ablation.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from candle_vllm import LLM, SamplingParams

STEP_END = "keys_to_indices"  # the greedy argmax's last kernel ends every decode step


def profile_decode(llm: LLM, prompts: list[dict[str, list[int]]], steps: int, rows: int) -> str:
    """torch-profiler tables of ``steps`` decode steps of ``prompts`` (prefilled first, outside the trace)."""
    from torch.profiler import ProfilerActivity, profile

    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # prefill now
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True))
        torch.cuda.synchronize()
    averages = prof.key_averages()
    return "\n".join([gpu_idle_report(prof), decode_idle_report(prof), critical_path_report(prof),
                      averages.table(sort_by="self_cuda_time_total", row_limit=rows),
                      averages.table(sort_by="self_cpu_time_total", row_limit=rows)])


def profile_ttft(llm: LLM, prompt: dict[str, list[int]], rows: int) -> str:
    """torch-profiler tables of one prefill of ``prompt`` (the TTFT step): GPU time per kernel, then host time per
    op, so the share of each kernel and of host gaps in the TTFT is visible."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([prompt], SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
    averages = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in averages)
    return (f"GPU kernel time in the profiled TTFT: {gpu_us / 1e3:.2f} ms\n" + gpu_idle_report(prof) + "\n"
            + averages.table(sort_by="self_cuda_time_total", row_limit=rows) + "\n"
            + averages.table(sort_by="self_cpu_time_total", row_limit=rows))


def _kernels(prof: Any) -> list[Any]:
    return sorted(
        (e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0),
        key=lambda e: e.time_range.start,
    )


def _decode_window(prof: Any) -> tuple[list[Any], int] | None:
    """The kernels from the first step end to the last, and the number of whole steps between them."""
    kernels = _kernels(prof)
    ends = [i for i, e in enumerate(kernels) if STEP_END in e.name]
    if len(ends) < 3:
        return None
    return kernels[ends[0]: ends[-1] + 1], len(ends) - 1


def short_name(kernel: str) -> str:
    """A kernel's name without its namespace, template arguments and parameters."""
    name = kernel.replace("(anonymous namespace)::", "").removeprefix("void ").split("(")[0].split("<")[0]
    return name.rsplit("::", 1)[-1][:40]


def gpu_idle_report(prof: Any, top: int = 8) -> str:
    """Where the GPU waited inside a profile: the span from the first to the last kernel, the idle time between
    kernels, and the longest gaps with the kernels on either side (host work the GPU waits for shows up here)."""
    kernels = _kernels(prof)
    if not kernels:
        return "no GPU kernels in the profile"
    gaps = []
    end = kernels[0].time_range.end
    for prev, cur in itertools.pairwise(kernels):
        end = max(end, prev.time_range.end)
        if cur.time_range.start > end:
            gaps.append((cur.time_range.start - end, prev.name[:40], cur.name[:40]))
    span = kernels[-1].time_range.end - kernels[0].time_range.start
    lines = [f"GPU span {span / 1e3:.2f} ms, idle between kernels {sum(g[0] for g in gaps) / 1e3:.2f} ms "
             f"({len(gaps)} gaps); longest:"]
    lines += [f"  {g:9.1f} us  after {a}  before {b}" for g, a, b in sorted(gaps, reverse=True)[:top]]
    return "\n".join(lines)


def decode_idle_report(prof: Any) -> str:
    """GPU idle time of the decode steps alone, split into the gaps right after a step's last kernel (between
    steps: host work the next step waits for) and the gaps inside steps, the latter by kernel pair."""
    found = _decode_window(prof)
    if found is None:
        return "decode window: fewer than two decode steps ending in the greedy argmax"
    window, steps = found
    between = inside = 0.0
    pairs: dict[tuple[str, str], float] = {}
    end = window[0].time_range.end
    for prev, cur in itertools.pairwise(window):
        end = max(end, prev.time_range.end)
        if cur.time_range.start > end:
            gap = cur.time_range.start - end
            if STEP_END in prev.name:
                between += gap
            else:
                inside += gap
                key = (short_name(prev.name), short_name(cur.name))
                pairs[key] = pairs.get(key, 0.0) + gap
    span = window[-1].time_range.end - window[0].time_range.end
    lines = [f"decode window: {steps} steps, {span / steps:.1f} us per step; idle per step {between / steps:.1f} us "
             f"between steps, {inside / steps:.1f} us inside steps; inside, by kernel pair (us per step):"]
    lines += [f"  {t / steps:7.1f}  {a} -> {b}" for (a, b), t in sorted(pairs.items(), key=lambda kv: -kv[1])[:8]]
    return "\n".join(lines)


def critical_path_report(prof: Any, context: int = 3, top: int = 16) -> str:
    """Each decode kernel's share of the step: how far its end moves past the latest end of the kernels before
    it (work it overlaps with adds nothing; idle gaps are left out). Kernels are told apart by the names of the
    ``context`` kernels before them, so the same GEMV after different producers (qkv after the input norm, o_proj
    after attention) gets its own line; the shares plus the idle time add up to the step."""
    found = _decode_window(prof)
    if found is None:
        return "critical path: fewer than two decode steps ending in the greedy argmax"
    window, steps = found
    names = [short_name(e.name) for e in window]
    shares: dict[tuple[str, ...], list[float]] = {}
    end = window[0].time_range.end
    for i in range(1, len(window)):
        e = window[i]
        start = max(end, e.time_range.start)
        key = tuple(names[max(0, i - context): i + 1])
        entry = shares.setdefault(key, [0.0, 0.0])
        entry[0] += max(0.0, e.time_range.end - start)
        entry[1] += 1
        end = max(end, e.time_range.end)
    total = sum(v[0] for v in shares.values()) / steps
    lines = [f"critical path: {total:.1f} us of kernel time per step; by kernel (after the {context} before it), "
             f"us per step, launches per step:"]
    for key, (t, n) in sorted(shares.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {t / steps:7.1f}  {n / steps:4.0f}x  {key[-1]}  (after {' < '.join(key[:-1])})")
    return "\n".join(lines)
