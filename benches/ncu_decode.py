"""A few launches of the batch-1 decode kernels for Nsight Compute (hardware counters, not timings).

    ncu --clock-control none -k regex:"gemv_q8_kernel|skinny_gemm_kernel|paged_decode" \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 benches/ncu_decode.py [--only gemv|attention|mmq|staged]

GEMVs: the q4k dp4a GEMV and the bf16 skinny GEMM (4 and 8 warps) on the Llama-3-8B o_proj [4096, 4096] and
down [4096, 14336] shapes at M = 1. Attention: one sequence at a 4k context in the grid the engine captures
(max_seq_len 8192), with the automatic plan and with one kv head per CTA and 512-token pieces (the slowest
per-CTA streaming rate of the sweep). Each runs several times; the counters say what limits these small grids:
achieved bandwidth, occupancy and why the warps stall. mmq: the int8 tensor-core product (q4k) at 8 and 16 rows on
the o_proj and gate_up shapes next to the dp4a GEMV at 1 and 8 rows, and q8_0's dp4a GEMV at 1 and 8, all on codes
an RMSNorm wrote (`-k regex:"gguf_mmq|gemv_q8_kernel"`). staged: the staged product at 4 and 8 rows (q4k, q8_0;
o_proj, down and gate_up).
"""

from __future__ import annotations

import argparse
import math

import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import cuda, cuda_gguf, cuda_paged
from candle_vllm.pyengine.ops.norm import rms_norm
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
    """The int8 tensor-core GGUF product (q4k) on the o_proj and gate_up shapes at 8 and 16 rows, next to the dp4a
    GEMV at 1 and 8 rows; q8_0's dp4a GEMV at 1 row (its loads re-read sectors through L1). Codes from an RMSNorm, as
    the decode step's producers write them."""
    for qtype, name, shapes in ((QT.Q4_K, "q4k", [(4096, 4096), (28672, 4096)]), (QT.Q8_0, "q8_0", [(4096, 4096)])):
        for n, k in shapes:
            blocks = quantize(torch.randn(n, k, device=DEV).to(torch.bfloat16), name)
            norm_w = torch.ones(k, device=DEV, dtype=torch.bfloat16)
            for m in (1, 8, 16):
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                for _ in range(2):
                    if qtype == QT.Q4_K and m > 1:
                        cuda_gguf.mmq(rms_norm(x, norm_w, 1e-5, q8=cuda_gguf.x_group(qtype)), blocks, qtype, n, k)
                    if m <= 8:
                        cuda_gguf.gemv(rms_norm(x, norm_w, 1e-5, q8=32), blocks, qtype, n, k)


def staged() -> None:
    """The staged GGUF product (weights streamed through shared memory) at 4 and 8 rows, q4k and q8_0, on the o_proj,
    down and gate_up shapes (`-k regex:gguf_mmq_staged`; benches/RESULTS.md, session 22: where its warps stall)."""
    for qtype, name in ((QT.Q4_K, "q4k"), (QT.Q8_0, "q8_0")):
        for n, k in ((4096, 4096), (4096, 14336), (28672, 4096)):
            blocks = quantize(torch.randn(n, k, device=DEV).to(torch.bfloat16), name)
            norm_w = torch.ones(k, device=DEV, dtype=torch.bfloat16)
            for m in (4, 8):
                x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
                q8 = rms_norm(x, norm_w, 1e-5, q8=cuda_gguf.x_group(qtype))
                for _ in range(2):
                    cuda_gguf.mmq(q8, blocks, qtype, n, k, staging=2)


def attention() -> None:
    hq, hk, d, bs, ctx, grid = 32, 8, 128, 64, 4096, 8192
    nblocks = math.ceil(ctx / bs)
    cache = torch.randn(2, nblocks, bs, hk, d, device=DEV).to(torch.bfloat16)
    table = torch.randperm(nblocks, device=DEV).view(1, -1).to(torch.int32)
    lens = torch.tensor([ctx], dtype=torch.int32, device=DEV)
    q = torch.randn(1, hq, d, device=DEV).to(torch.bfloat16)
    plans: tuple[tuple[int | None, int | None], ...] = ((None, None), (1, 512))  # (heads_per_cta, partition_size)
    for heads_per_cta, partition_size in plans:
        for _ in range(4):
            cuda_paged.paged_decode_attention(q, cache, table, lens, d**-0.5, grid, heads_per_cta=heads_per_cta,
                                              partition_size=partition_size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["gemv", "attention", "mmq", "staged"])
    args = ap.parse_args()
    if args.only in (None, "gemv"):
        gemvs()
    if args.only in (None, "attention"):
        attention()
    if args.only in (None, "mmq"):
        mmq()
    if args.only in (None, "staged"):
        staged()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
