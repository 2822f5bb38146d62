# ruff: noqa: B023  (each timing lambda is captured and replayed before its loop variables move on)
"""The TurboQuant decode attention kernels alone, on Llama-3-8B heads (32 q / 8 kv, D = 128, block size 64).

Why: end to end, the turbo caches' decode step hides which kernel is slow and why. This times the tensor-core
kernel (``turbo_decode_tc.cu``) against the CUDA-core one (``turbo_decode.cu``) at the shapes of bench_decode.py
(batch 1 at 4k, batch 64 at 1k, and batch 16 at 4k between them) as the engine's CUDA graphs capture them (for
8192 tokens) and batch 64 also for its own context, each as microseconds per layer and GB/s over the row bytes it
must read, beside the dense bf16 paged decode kernel over the same context. For turbo4 it sweeps the pieces each
sequence is cut into (``cuda_turbo.decode_pieces`` picks them). Timings replay a CUDA graph rotating over enough
cache copies to defeat the L2 (``bench_kernels.graph_seconds``).

    python3 benches/bench_turbo_decode.py [--json out.json]
    ncu -k regex:turbo_decode --section SpeedOfLight --section Occupancy --section WarpStateStats \
        python3 benches/bench_turbo_decode.py --profile 64x1024 --modes turbo4   # a few launches, no graphs
"""

from __future__ import annotations

import argparse
import json
import math

import torch
from bench_kernels import copies_for, graph_seconds

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda_paged, cuda_turbo

DEV = torch.device("cuda")
HQ, HK, D, BLOCK = 32, 8, 128, 64
CASES = ((1, 4096, 8192), (16, 4096, 8192), (64, 1024, 8192), (64, 1024, 1024))  # batch, context, grid
SWEEP = (1, 2, 4, 8, 16, 32, 64)


def turbo_cache(fmt: TurboFormat, b: int, ctx: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of ``b`` sequences of ``ctx`` tokens written by the write kernel from random k/v, over shuffled
    blocks: the cache, block tables int32 [b, ctx / BLOCK] and seq_lens int32 [b]."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    per_seq = math.ceil(ctx / BLOCK)
    cache = torch.zeros(1, b * per_seq, BLOCK, HK, fmt.row_bytes, dtype=torch.uint8, device=DEV)
    tables = torch.randperm(b * per_seq, generator=g, device=DEV).view(b, per_seq).to(torch.int32)
    pos = torch.arange(ctx, device=DEV)
    for s in range(b):
        slots = tables[s, pos // BLOCK].long() * BLOCK + pos % BLOCK
        k = (torch.randn(ctx, HK, D, generator=g, device=DEV) * 2).to(torch.bfloat16)
        v = torch.randn(ctx, HK, D, generator=g, device=DEV).to(torch.bfloat16)
        cuda_turbo.turbo_cache_write(k, v, cache, slots, fmt)
    return cache, tables, torch.full((b,), ctx, dtype=torch.int32, device=DEV)


def time_case(mode: str, b: int, ctx: int, grid: int, sweep: bool, results: list[dict]) -> None:
    """One mode at one shape: both turbo kernels with the pieces of ``decode_pieces`` (and with ``sweep``, each count
    of pieces per sequence in SWEEP) and the dense bf16 kernel, printed and appended to ``results``."""
    fmt = TurboFormat(mode, D)
    row_bytes = b * ctx * HK * fmt.row_bytes
    copies = copies_for(row_bytes, cap=8)
    made = [turbo_cache(fmt, b, ctx, seed) for seed in range(copies)]
    q = torch.randn(b, HQ, D, device=DEV).to(torch.bfloat16)
    row: dict = dict(mode=mode, b=b, ctx=ctx, grid=grid, row_bytes=row_bytes)
    row["auto_pieces"] = cuda_turbo.decode_pieces(b, HQ, HK, grid, DEV)
    for name, tc in (("tensor_cores", True), ("cuda_cores", False)):
        if tc and not cuda_turbo.tensor_cores_take(fmt, BLOCK):
            continue
        for pieces in (None, *SWEEP) if sweep else (None,):
            us = 1e6 * graph_seconds(lambda i: cuda_turbo.turbo_decode_attention(
                q, made[i % copies][0], made[i % copies][1], made[i % copies][2], D**-0.5, grid, fmt,
                tensor_cores=tc, pieces=pieces))
            row[name if pieces is None else f"{name}/p{pieces}"] = dict(us=us, gbps=row_bytes / us / 1e3)
    dense_bytes = 2 * b * ctx * HK * D * 2
    dense_copies = copies_for(dense_bytes, cap=8)
    caches = [torch.randn(2, b * math.ceil(ctx / BLOCK), BLOCK, HK, D, device=DEV).to(torch.bfloat16)
              for _ in range(dense_copies)]
    tables, lens = made[0][1], made[0][2]
    row["dense_bf16_us"] = 1e6 * graph_seconds(lambda i: cuda_paged.paged_decode_attention(
        q, caches[i % dense_copies], tables, lens, D**-0.5, grid))
    cells = "  ".join(f"{k} {v['us']:.1f} us ({v['gbps']:.0f} GB/s)" for k, v in row.items() if isinstance(v, dict))
    print(f"{mode} B={b} ctx={ctx} grid={grid} rows {row_bytes / 1e6:.1f} MB, {row['auto_pieces']} pieces: {cells}  "
          f"dense bf16 {row['dense_bf16_us']:.1f} us", flush=True)
    results.append(row)


def profile(mode: str, b: int, ctx: int) -> None:
    """A few plain launches of each turbo kernel for Nsight Compute, in the engine's graph grid."""
    fmt = TurboFormat(mode, D)
    cache, tables, lens = turbo_cache(fmt, b, ctx, 0)
    q = torch.randn(b, HQ, D, device=DEV).to(torch.bfloat16)
    for tc in (True, False):
        for _ in range(3):
            cuda_turbo.turbo_decode_attention(q, cache, tables, lens, D**-0.5, 8192, fmt, tensor_cores=tc)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", nargs="+", default=["turbo8", "turbo4", "turbo3"])
    parser.add_argument("--profile", help="BxCTX: launch each kernel a few times at this shape (grid 8192) for ncu")
    parser.add_argument("--sweep", nargs="*", default=["turbo4"], help="modes whose pieces per sequence are swept")
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args()
    if args.profile:
        b, ctx = map(int, args.profile.split("x"))
        for mode in args.modes:
            profile(mode, b, ctx)
        return
    results: list[dict] = []
    for mode in args.modes:
        for b, ctx, grid in CASES:
            time_case(mode, b, ctx, grid, mode in args.sweep, results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), rows=results), f, indent=1)


if __name__ == "__main__":
    main()
