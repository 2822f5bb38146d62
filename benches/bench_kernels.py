# ruff: noqa: B023  (each timing lambda is captured and replayed before its loop variables move on)
"""Micro-benchmarks of the CUDA kernels on Llama-3-8B decode shapes, against torch/cuBLAS.

Why: issue 5's decode budget is set by HBM bandwidth, so each kernel is reported as time and achieved GB/s
over the bytes it must move, next to the measured device-to-device copy bandwidth (the practical ceiling).
Each timing replays a CUDA graph of many calls (no Python/launch gaps), rotating over enough input copies
to defeat the 60 MB L2, median of several replays. Run: ``python benches/bench_kernels.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import traceback
from collections.abc import Callable

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops import cuda, cuda_paged, cuda_rotary, cuda_wide, norm

DEV = torch.device("cuda")
BF16 = torch.bfloat16
ROTATE_BYTES = 512 << 20  # inputs rotated over at least this many bytes


def graph_seconds(fn: Callable[[int], object], calls: int = 20, reps: int = 15) -> float:
    """Median seconds per fn(i) call, from replays of a graph holding `calls` calls."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def copies_for(nbytes: int, cap: int = 16) -> int:
    return max(2, min(cap, math.ceil(ROTATE_BYTES / max(1, nbytes))))


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second, timed eagerly: inside a CUDA graph the copy
    becomes a memcpy node that can run on a copy engine (measured 2.8 TB/s that way on the H200)."""
    n = 1 << 30
    a, b = torch.empty(n, dtype=torch.uint8, device=DEV), torch.empty(n, dtype=torch.uint8, device=DEV)
    a.random_(0, 255)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n / statistics.median(times[2:])


GEMM_MS = (1, 4, 8, 16)


def gemm_rows(peak: float, results: list[dict], ms: tuple[int, ...] = GEMM_MS) -> None:
    shapes = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
              ("lm_head", 128256, 4096)]
    print(f"\n== skinny GEMM bf16 (copy ceiling {peak / 1e9:.0f} GB/s) ==")
    print(f"{'shape':<24}{'M':>3}{'ours us':>10}{'GB/s':>8}{'%ceil':>7}{'cuBLAS us':>11}{'GB/s':>8}{'speedup':>9}")
    for name, n, k in shapes:
        copies = copies_for(n * k * 2)
        ws = [torch.randn(n, k, device=DEV).to(BF16) for _ in range(copies)]
        for m in ms:
            x = torch.randn(m, k, device=DEV).to(BF16)
            want = x.double() @ ws[0].double().T
            err = ((cuda.skinny_gemm(x, ws[0]).double() - want).norm() / want.norm()).item()
            nbytes = n * k * 2 + m * (k + n) * 2
            ours = graph_seconds(lambda i: cuda.skinny_gemm(x, ws[i % copies]))
            blas = graph_seconds(lambda i: F.linear(x, ws[i % copies]))
            row = dict(kernel="skinny_gemm", shape=f"{name} {n}x{k}", m=m, us=ours * 1e6, gbps=nbytes / ours / 1e9,
                       cublas_us=blas * 1e6, cublas_gbps=nbytes / blas / 1e9, rel_err=err)
            results.append(row)
            print(f"{row['shape']:<24}{m:>3}{ours * 1e6:>10.1f}{row['gbps']:>8.0f}{100 * nbytes / ours / peak:>6.0f}%"
                  f"{blas * 1e6:>11.1f}{row['cublas_gbps']:>8.0f}{blas / ours:>8.2f}x  err {err:.1e}")
    sweep_ms = [m for m in (1, 8, 16) if m in ms]
    print(f"\n-- CTA size x split-K sweep (M={sweep_ms}; cells w<warps>s<splits>:us) --")
    for name, n, k in [("o_proj", 4096, 4096), ("down", 4096, 14336), ("qkv", 6144, 4096), ("gate_up", 28672, 4096)]:
        copies = copies_for(n * k * 2)
        ws = [torch.randn(n, k, device=DEV).to(BF16) for _ in range(copies)]
        for m in sweep_ms:
            x = torch.randn(m, k, device=DEV).to(BF16)
            cells = []
            for warps in (4, 8):
                for splits in (1, 2, 3, 4):
                    t = graph_seconds(lambda i, s=splits, w=warps: cuda.skinny_gemm(x, ws[i % copies], splits=s, warps=w))
                    cells.append(f"w{warps}s{splits}:{t * 1e6:.1f}")
                    results.append(dict(kernel="skinny_gemm_sweep", shape=f"{name} {n}x{k}", m=m, warps=warps,
                                        splits=splits, us=t * 1e6, pct=100 * n * k * 2 / t / peak))
            auto = cuda.skinny_gemm_splits(n, k, cuda.sm_count(0))
            print(f"{name} {n}x{k} M={m} (auto s{auto}): " + "  ".join(cells))


def wide_rows(peak: float, results: list[dict]) -> None:
    """The Hopper GEMM for 17..64 rows against cuBLAS on the 8B shapes (dispatched: where UnquantizedLinear sends
    those batches to it, the weights with more 256-row tiles than SMs)."""
    shapes = [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336),
              ("lm_head", 128256, 4096)]
    print(f"\n== wide GEMM bf16, TMA + wgmma (copy ceiling {peak / 1e9:.0f} GB/s) ==")
    for name, n, k in shapes:
        copies = copies_for(n * k * 2)
        ws = [torch.randn(n, k, device=DEV).to(BF16) for _ in range(copies)]
        nbytes = n * k * 2
        for m in (32, 64):
            x = torch.randn(m, k, device=DEV).to(BF16)
            want = x.double() @ ws[0].double().T
            err = ((cuda_wide.wide_gemm(x, ws[0]).double() - want).norm() / want.norm()).item()
            ours = graph_seconds(lambda i: cuda_wide.wide_gemm(x, ws[i % copies]))
            blas = graph_seconds(lambda i: F.linear(x, ws[i % copies]))
            used = cuda_wide.wide_gemm_preferred(x, ws[0])
            results.append(dict(kernel="wide_gemm", shape=f"{name} {n}x{k}", m=m, us=ours * 1e6, cublas_us=blas * 1e6,
                                dispatched=used, rel_err=err))
            print(f"{name} {n}x{k} M={m}: {ours * 1e6:.1f} us ({100 * nbytes / ours / peak:.0f} %), cuBLAS "
                  f"{blas * 1e6:.1f} us ({100 * nbytes / blas / peak:.0f} %), x{blas / ours:.2f}, err {err:.1e}"
                  f"{' (dispatched)' if used else ''}")


def attention_rows(peak: float, results: list[dict], kv_dtype: torch.dtype = BF16) -> None:
    """Llama-3-8B heads (32 q / 8 kv, D=128) at the CUDA default block size 64 and the earlier rows' 16, batch 1
    with the grid a CUDA graph captures (max_seq_len 8192 while the context is 4096). Each case: the automatic
    plan (heads per CTA, partition, warps per head, reduce form) and a sweep of heads per CTA x warps per kv
    head ("h2s4": 2 heads, 4 warps each) x partition size, each cell with the reduce kernel and, up to 16 pieces,
    the fused last-CTA reduce ("kernel/fused" us), so the plan's rule (ops/cuda_paged.py decode_plan,
    _FUSED_REDUCE_MAX_PARTS) can be set from one run. ``kv_dtype``: the cache's (bf16, or e4m3 for
    --kvcache-dtype fp8, half the bytes)."""
    hq, hk, d = 32, 8, 128
    print(f"\n== paged decode attention bf16 q, {kv_dtype} cache (Llama-3-8B heads 32/8, D=128) ==")
    cases = [(1, 4096, 64, 4096), (1, 4096, 64, 8192), (1, 32768, 64, 32768), (64, 1024, 64, 1024),
             (16, 4096, 64, 4096), (1, 4096, 16, 4096), (64, 1024, 16, 1024), (4, 4096, 64, 4096)]
    sizes = (16, 32, 64, 128, 256, 512, 1024)
    for b, ctx, bs, max_len in cases:
        blocks_per_seq = math.ceil(ctx / bs)
        nblocks = b * blocks_per_seq
        kv_bytes = 2 * b * ctx * hk * d * kv_dtype.itemsize
        copies = copies_for(kv_bytes, cap=8)
        caches = [torch.randn(2, nblocks, bs, hk, d, device=DEV).to(kv_dtype) for _ in range(copies)]
        tables = torch.randperm(nblocks, device=DEV).view(b, blocks_per_seq).to(torch.int32)
        lens = torch.full((b,), ctx, dtype=torch.int32, device=DEV)
        q = torch.randn(b, hq, d, device=DEV).to(BF16)

        def timed(partition_size: int | None = None, heads_per_cta: int | None = None, splits: int | None = None,
                  fused_reduce: bool | None = None) -> float:
            return 1e6 * graph_seconds(lambda i: cuda_paged.paged_decode_attention(
                q, caches[i % copies], tables, lens, d**-0.5, max_len, partition_size=partition_size,
                heads_per_cta=heads_per_cta, fused_reduce=fused_reduce, splits=splits))

        plan = cuda_paged.auto_decode_plan(q, caches[0], max_len)
        auto_parts = math.ceil(max_len / plan.partition_size)
        auto_us = timed()
        sweep: dict[str, float] = {}
        print(f"B={b} ctx={ctx} bs={bs} grid={max_len}: auto heads/CTA {plan.heads_per_cta} x {plan.splits} warps, "
              f"partition {plan.partition_size} ({auto_parts} pieces, {'fused' if cuda_paged.decode_fused_reduce(auto_parts) else 'kernel'}"
              f" reduce) {auto_us:.1f} us, {kv_bytes / auto_us / 1e3:.0f} GB/s, {100 * kv_bytes / auto_us / 1e-6 / peak:.0f}%")
        print(f"{'  heads x warps':<18}" + "".join(f"{f'p{p}':>14}" for p in sizes if p <= max_len))
        for heads, splits in ((8, 1), (4, 1), (4, 2), (2, 1), (2, 2), (2, 4), (1, 1), (1, 2), (1, 4)):
            cells = []
            for size in sizes:
                if size > max_len:
                    continue
                if size < 16 * splits:  # less than one stage
                    cells.append("-")
                    continue
                parts = math.ceil(max_len / size)
                us = timed(size, heads, splits, fused_reduce=False)
                sweep[f"h{heads}s{splits}/p{size}"] = us
                cell = f"{us:.1f}"
                if 1 < parts <= 16:
                    fused = timed(size, heads, splits, fused_reduce=True)
                    sweep[f"h{heads}s{splits}/p{size}/fused"] = fused
                    cell += f"/{fused:.1f}"
                cells.append(cell)
            print(f"{f'  h{heads}s{splits}':<18}" + "".join(f"{c:>14}" for c in cells))
        best = min(sweep, key=sweep.__getitem__)
        sdpa_us = float("nan")
        if b == 1 and bs == 64 and max_len == ctx:
            kc = [torch.randn(1, hk, ctx, d, device=DEV).to(BF16) for _ in range(copies)]
            q4 = q.view(1, hq, 1, d)
            sdpa_us = 1e6 * graph_seconds(
                lambda i: F.scaled_dot_product_attention(q4, kc[i % copies], kc[i % copies], enable_gqa=True))
        print(f"  best {best} {sweep[best]:.1f} us ({100 * kv_bytes / sweep[best] / 1e-6 / peak:.0f}%), "
              f"auto {auto_us:.1f} us, SDPA contiguous {sdpa_us:.1f} us")
        results.append(dict(kernel="paged_decode", kv_dtype=str(kv_dtype), b=b, ctx=ctx, block_size=bs, max_seq_len=max_len, us=auto_us,
                            gbps=kv_bytes / auto_us / 1e3, sdpa_us=sdpa_us, auto_heads_per_cta=plan.heads_per_cta,
                            auto_partition=plan.partition_size, best=best, sweep_us=sweep))


PREFILL_CASES = [([4096], [4096]), ([8192], [8192]), ([1024] * 4, [1024] * 4), ([2048], [4096])]


def _prefill_case(query_lens: list[int], seq_lens: list[int], hq: int, hk: int, d: int, bs: int) -> tuple:
    """Engine-shaped inputs: q/k/v views into a fused qkv output [T, (Hq+2Hk)*D], a cache with scattered blocks
    holding a random prefix and the step's own k/v, the step's metadata, and the causal FLOPs."""
    from candle_vllm.pyengine.ops.attention import AttentionMetadata

    tables, at = [], 0
    for ctx in seq_lens:
        n = math.ceil(ctx / bs)
        tables.append(list(range(at, at + n)))
        at += n
    perm = torch.randperm(at).tolist()
    tables = [[perm[b] for b in t] for t in tables]
    cache = torch.randn(2, at, bs, hk, d, device=DEV).to(BF16)
    t = sum(query_lens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, device=DEV).to(BF16)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    meta = AttentionMetadata.build(query_lens, seq_lens, DEV, tables, bs)
    assert meta.slot_mapping is not None  # set whenever block tables are given
    cuda_paged.reshape_and_cache(k, v, cache, meta.slot_mapping)
    pairs = sum(q_len * (ctx - q_len) + q_len * (q_len + 1) // 2 for q_len, ctx in zip(query_lens, seq_lens, strict=True))
    return q, k, v, cache, meta, 4 * hq * d * pairs


def eager_seconds(fn: Callable[[], object], calls: int = 10, reps: int = 7) -> float:
    """Median seconds per fn() issued eagerly, as the engine issues prefill steps (no CUDA graph), so a backend's
    host work per call counts wherever the GPU would wait for it."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    return statistics.median(times)


def _per_sequence(fn: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """fn on each sequence's rows (one call each, as the engine's cuDNN route does), outputs stacked [T, Hq, D]."""
    outs, at = [], 0
    for n in lens:
        outs.append(fn(q[at : at + n], k[at : at + n], v[at : at + n]))
        at += n
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def prefill_backend_rows(results: list[dict]) -> None:
    """Prefill attention backends on exactly the engine's inputs (q/k/v views into the fused qkv output after RoPE,
    Llama-3-8B heads 32/8, D=128, bf16), timed eagerly as the engine issues them: ours (the paged cache), torch's
    flash kernel through its varlen entry point (all sequences in one launch, strided views, GQA in the kernel),
    SDPA pinned to flash or cuDNN per sequence in each layout (views with GQA, contiguous copies, K/V expanded to
    32 heads), with the layout change timed and, for the copying layouts, also without it. A cached prefix is
    only ours to run (it lives in the paged cache). err: relative to ours."""
    from candle_vllm.pyengine.ops import sdpa_prefill
    from candle_vllm.pyengine.ops.cuda_prefill import flash_prefill

    hq, hk, d, bs = 32, 8, 128, 64
    scale = d**-0.5
    cudnn_version = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    print(f"\n== prefill attention backends, engine inputs (q/k/v views of qkv, 32/8 heads, D=128, bf16), eager; "
          f"cuDNN {cudnn_version} ==")
    print(f"{'case':<22}{'variant':<52}{'us':>10}{'TF/s':>7}{'err':>10}")
    for query_lens, seq_lens in PREFILL_CASES:
        q, k, v, cache, meta, flops = _prefill_case(query_lens, seq_lens, hq, hk, d, bs)
        case = f"{len(query_lens)}x q{query_lens[0]} ctx{seq_lens[0]}"
        ours_out = flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens),
                                 scale)
        variants: list[tuple[str, Callable[[], torch.Tensor]]] = [
            ("ours (paged cache, default tiling)", lambda: flash_prefill(
                q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens), scale)),
        ]
        fresh = query_lens == seq_lens
        if fresh:
            run = meta.fresh_runs[0]
            variants.append(("flash varlen (views, GQA, 1 launch) = sdpa-flash",
                             lambda: sdpa_prefill.flash_varlen(q, k, v, run.cu_seqlens(DEV), run.max_len, scale)))
            for backend in ("sdpa-flash", "sdpa-cudnn"):
                for layout in sdpa_prefill.CUDNN_LAYOUTS:
                    variants.append((f"SDPA {backend[5:]} per seq, {layout} (incl. layout)", lambda b=backend, lay=layout:
                                     _per_sequence(lambda qs, ks, vs: sdpa_prefill.sdpa_sequence(
                                                       b, qs, ks, vs, scale, lay), q, k, v, query_lens)))
                    if layout != "view":
                        ready = [sdpa_prefill.to_layout(q[a:b], k[a:b], v[a:b], layout)
                                 for a, b in itertools.pairwise(meta.query_start_loc_cpu)]
                        variants.append((f"SDPA {backend[5:]} per seq, {layout} (excl. layout)",
                                         lambda b=backend, ready=ready: torch.cat(
                                             [sdpa_prefill.sdpa_heads_first(b, q4, k4, v4, scale)[0].transpose(0, 1)
                                              for q4, k4, v4 in ready])))
            layouts = [sdpa_prefill.cudnn_plan(q[a:b], k[a:b], v[a:b])
                       for a, b in itertools.pairwise(meta.query_start_loc_cpu)]
            variants.append((f"engine sdpa-cudnn route (layout {layouts[0]})",
                             lambda: sdpa_prefill.attend_fresh("sdpa-cudnn", q, k, v, run, scale)))
        for name, fn in variants:
            row: dict[str, object] = dict(
                kernel="prefill_backend", case=case, variant=name, query_lens=query_lens, seq_lens=seq_lens
            )
            try:
                err = ((fn().double() - ours_out.double()).norm() / ours_out.double().norm()).item()
                sec = eager_seconds(fn)
                row.update(us=sec * 1e6, tflops=flops / sec / 1e12, rel_err_vs_ours=err)
                print(f"{case:<22}{name:<52}{sec * 1e6:>10.1f}{flops / sec / 1e12:>7.0f}{err:>10.1e}")
            except Exception as exc:  # a backend refusing these inputs is a result, not a crash
                error = f"{type(exc).__name__}: {exc}"
                row.update(error=error)
                print(f"{case:<22}{name:<52}  failed: {error.splitlines()[0][:120]}")
            results.append(row)
        if not fresh:
            print(f"{case:<22}{'SDPA / flash varlen':<52}  n/a: the cached prefix is in the paged cache (ours only)")


def prefill_rows(peak: float, results: list[dict]) -> None:
    """Flash prefill attention (32 q / 8 kv heads, D=128, bf16, cache block 64) in causal TFLOP/s (4 * Hq * D
    per attended (query, key) pair) for every compiled tiling (graph replays); then the backends on the engine's
    inputs (``prefill_backend_rows``); then cuBLAS on the prefill linears at M=4096, the compute ceiling the TTFT
    budget rests on. Inputs are not rotated: the kernels are compute-bound."""
    from candle_vllm.pyengine.ops.cuda_prefill import KERNEL_CONFIGS, flash_prefill

    hq, hk, d, bs = 32, 8, 128, 64
    print("\n== flash prefill attention bf16 (32/8 heads, D=128, block 64), causal TFLOP/s per tiling "
          "(block_m x warp_rows x block_n), graph replays ==")
    configs = KERNEL_CONFIGS[d]
    print(f"{'case':<26}" + "".join(f"{'x'.join(map(str, c)) + ' us':>15}{'TF/s':>6}" for c in configs))
    for query_lens, seq_lens in PREFILL_CASES:
        q, _, _, cache, meta, flops = _prefill_case(query_lens, seq_lens, hq, hk, d, bs)
        times = {c: graph_seconds(lambda i, c=c: flash_prefill(
            q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens), d**-0.5, config=c),
            calls=10, reps=7) for c in configs}
        results.append(dict(kernel="flash_prefill", query_lens=query_lens, seq_lens=seq_lens,
                            us={"x".join(map(str, c)): v * 1e6 for c, v in times.items()},
                            tflops={"x".join(map(str, c)): flops / v / 1e12 for c, v in times.items()}))
        case = f"{len(query_lens)}x q{query_lens[0]} ctx{seq_lens[0]}"
        print(f"{case:<26}" + "".join(f"{v * 1e6:>15.1f}{flops / v / 1e12:>6.0f}" for v in times.values()))
    prefill_backend_rows(results)
    print("\n-- cuBLAS (F.linear) on the prefill linears, M=4096 --")
    total = 0.0
    for name, n, k in [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]:
        x = torch.randn(4096, k, device=DEV).to(BF16)
        w = torch.randn(n, k, device=DEV).to(BF16) * k**-0.5
        sec = graph_seconds(lambda i: F.linear(x, w), calls=10, reps=7)
        total += sec
        tf = 2 * 4096 * n * k / sec / 1e12
        results.append(dict(kernel="prefill_linear", shape=f"{name} {n}x{k}", m=4096, us=sec * 1e6, tflops=tf))
        print(f"{name + f' {n}x{k}':<34}{sec * 1e6:>11.1f}{tf:>9.0f}")
    print(f"{'per layer / x32 layers (ms)':<34}{total * 1e6:>11.1f}{total * 32e3:>9.2f}")


def elementwise_rows(peak: float, results: list[dict]) -> None:
    print("\n== element-wise kernels bf16 (ours vs torch eager ops, both in graphs) ==")
    print(f"{'case':<34}{'ours us':>10}{'GB/s':>8}{'torch us':>10}")
    for rows in (64, 4096):
        copies = copies_for(rows * 4096 * 2)
        xs = [torch.randn(rows, 4096, device=DEV).to(BF16) for _ in range(copies)]
        rs = [torch.randn(rows, 4096, device=DEV).to(BF16) for _ in range(copies)]
        w = torch.randn(4096, device=DEV).to(BF16)
        nb = 2 * rows * 4096 * 2
        ours = graph_seconds(lambda i: norm.rms_norm(xs[i % copies], w, 1e-5))
        ref = graph_seconds(lambda i: norm.rms_norm_reference(xs[i % copies], w, 1e-5))
        _report(results, f"rms_norm rows={rows} h=4096", ours, nb, ref)
        nb = 4 * rows * 4096 * 2
        ours = graph_seconds(lambda i: norm.fused_add_rms_norm(xs[i % copies], rs[i % copies], w, 1e-5))
        ref = graph_seconds(lambda i: norm.fused_add_rms_norm_reference(xs[i % copies], rs[i % copies], w, 1e-5))
        _report(results, f"fused_add_rms_norm rows={rows}", ours, nb, ref)
        copies = copies_for(rows * 28672 * 2)
        gs = [torch.randn(rows, 28672, device=DEV).to(BF16) for _ in range(copies)]
        nb = rows * 28672 * 2 * 3 // 2
        ours = graph_seconds(lambda i: cuda.silu_and_mul(gs[i % copies]))
        ref = graph_seconds(lambda i: F.silu(gs[i % copies][:, :14336]) * gs[i % copies][:, 14336:])
        _report(results, f"silu_and_mul tokens={rows} d=14336", ours, nb, ref)
    for rows in (1, 64):
        logits = torch.randn(rows, 128256, device=DEV)
        ours = graph_seconds(lambda i: cuda.argmax(logits))
        ref = graph_seconds(lambda i: torch.argmax(logits, dim=-1))
        _report(results, f"argmax f32 rows={rows} V=128256", ours, rows * 128256 * 4, ref)


def rotary_rows(peak: float, results: list[dict]) -> None:
    """RoPE on Llama-3-8B heads (views into the fused qkv output), alone and fused with the paged-cache write,
    against the plain kernel followed by reshape_and_cache (the two launches the fused one replaces)."""
    print("\n== rotary bf16, q32/k8 heads D=128 (fused = RoPE + K/V cache write in one launch) ==")
    print(f"{'case':<34}{'ours us':>10}{'GB/s':>8}{'2-launch us':>12}")
    inv = 1.0 / (500000 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=DEV) / 128))
    fr = torch.outer(torch.arange(8192, dtype=torch.float32, device=DEV), inv)
    table = torch.cat([fr.cos(), fr.sin()], -1)
    for rows in (1, 64, 4096):
        qkv = torch.randn(rows, 6144, device=DEV).to(BF16)
        q, k, v = (t.view(rows, -1, 128) for t in qkv.split([4096, 1024, 1024], dim=-1))
        pos = torch.randint(0, 8192, (rows,), device=DEV)
        cache = torch.randn(2, 4096, 16, 8, 128, device=DEV).to(BF16)
        slots = torch.randperm(4096 * 16, device=DEV)[:rows]
        ours = graph_seconds(lambda i: cuda_rotary.rotary_embedding_(q, k, pos, table, True))
        _report(results, f"rotary tokens={rows}", ours, 2 * rows * 5120 * 2 + rows * 128 * 4, float("nan"))
        fused = graph_seconds(lambda i: cuda_rotary.rotary_embedding_cache_(q, k, v, pos, table, True, cache, slots))

        def two_launches(i: int) -> None:
            cuda_rotary.rotary_embedding_(q, k, pos, table, True)
            cuda_paged.reshape_and_cache(k, v, cache, slots)

        two = graph_seconds(two_launches)
        _report(results, f"rotary+cache tokens={rows}", fused, rows * (2 * 5120 + 2 * 1024 + 2 * 1024) * 2, two)


def _report(results: list[dict], case: str, ours: float, nbytes: int, ref: float) -> None:
    results.append(dict(kernel=case, us=ours * 1e6, gbps=nbytes / ours / 1e9, torch_us=ref * 1e6))
    print(f"{case:<34}{ours * 1e6:>10.1f}{nbytes / ours / 1e9:>8.0f}{ref * 1e6:>10.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write all rows to this file")
    parser.add_argument("--only", help="comma-separated sections: elementwise, rotary, attention, gemm, prefill, wide")
    parser.add_argument("--gemm-m", default=",".join(map(str, GEMM_MS)), help="skinny GEMM row counts to time")
    parser.add_argument("--kv-dtype", choices=("bf16", "fp8"), default="bf16",
                        help="the attention section's cache: bf16, or e4m3 (--kvcache-dtype fp8)")
    args = parser.parse_args()
    only = set(args.only.split(",")) if args.only else None
    ms = tuple(int(m) for m in args.gemm_m.split(","))
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    peak = copy_bandwidth()
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}; "
          f"copy bandwidth {peak / 1e9:.0f} GB/s (read + write)")
    results: list[dict] = [dict(kernel="copy", gbps=peak / 1e9, device=props.name)]
    kv_dtype = BF16 if args.kv_dtype == "bf16" else torch.float8_e4m3fn
    sections = {"elementwise": elementwise_rows, "rotary": rotary_rows,
                "attention": lambda p, r: attention_rows(p, r, kv_dtype),
                "gemm": lambda p, r: gemm_rows(p, r, ms), "prefill": prefill_rows, "wide": wide_rows}
    if only and not only <= sections.keys():
        parser.error(f"unknown sections {sorted(only - sections.keys())}; choose from {sorted(sections)}")
    for name, section in sections.items():
        if only and name not in only:
            continue
        try:
            section(peak, results)
        except Exception:  # one broken section must not hide the others' numbers
            traceback.print_exc()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
