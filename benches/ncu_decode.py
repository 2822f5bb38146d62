"""A few launches of the batch-1 decode kernels for Nsight Compute (hardware counters, not timings).

    ncu --clock-control none -k regex:"gemv_q8_kernel|skinny_gemm_kernel|paged_decode" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 benches/ncu_decode.py [--only gemv|attention]

GEMVs: the q4k dp4a GEMV and the bf16 skinny GEMM (4 and 8 warps) on the Llama-3-8B o_proj [4096, 4096] and
down [4096, 14336] shapes at M = 1. Attention: one sequence at a 4k context in the grid the engine captures
(max_seq_len 8192), with the automatic plan and with one kv head per CTA and 512-token pieces (the slowest
per-CTA streaming rate of the sweep). Each runs several times; the counters say what limits these small grids:
achieved bandwidth, occupancy and why the warps stall. mmq: the int8 tensor-core product (q4k, 28672x4096) at 8,
16 and 32 rows next to the dp4a GEMV at 8 (`-k regex:"gguf_mmq|gemv_q8_kernel"`).
"""

from __future__ import annotations

import argparse
import math

import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import cuda, cuda_gguf, cuda_paged
from candle_vllm.pyengine.quant.isq import quantize

DEV = torch.device("cuda")


def gemvs() -> None:
    for n, k in [(4096, 4096), (4096, 14336)]:
        w = torch.randn(n, k, device=DEV).to(torch.bfloat16)
        blocks = quantize(w, "q4k")
        x = torch.randn(1, k, device=DEV).to(torch.bfloat16)
        for _ in range(4):
            cuda_gguf.gemv(x, blocks, QT.Q4_K, n, k)
        for warps in (4, 8):
            for _ in range(4):
                cuda.skinny_gemm(x, w, warps=warps)


def mmq() -> None:
    """The int8 tensor-core GGUF product (q4k, gate_up shape) at 8, 16 and 32 rows, and the dp4a GEMV at 8."""
    n, k = 28672, 4096
    blocks = quantize(torch.randn(n, k, device=DEV).to(torch.bfloat16), "q4k")
    for m in (8, 16, 32):
        x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
        for _ in range(3):
            cuda_gguf.mmq(x, blocks, QT.Q4_K, n, k)
    x = torch.randn(8, k, device=DEV).to(torch.bfloat16)
    for _ in range(3):
        cuda_gguf.gemv(x, blocks, QT.Q4_K, n, k)


def attention() -> None:
    hq, hk, d, bs, ctx, grid = 32, 8, 128, 64, 4096, 8192
    nblocks = math.ceil(ctx / bs)
    cache = torch.randn(2, nblocks, bs, hk, d, device=DEV).to(torch.bfloat16)
    table = torch.randperm(nblocks, device=DEV).view(1, -1).to(torch.int32)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    q = torch.randn(1, hq, d, device=DEV).to(torch.bfloat16)
    for kw in ({}, {"heads_per_cta": 1, "partition_size": 512}):
        for _ in range(4):
            cuda_paged.paged_decode_attention(q, cache, table, lens, d**-0.5, grid, **kw)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["gemv", "attention", "mmq"])
    args = ap.parse_args()
    if args.only in (None, "gemv"):
        gemvs()
    if args.only in (None, "attention"):
        attention()
    if args.only in (None, "mmq"):
        mmq()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
