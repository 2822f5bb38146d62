"""A few launches of the batch-1 decode GEMVs for Nsight Compute (hardware counters, not timings).

    ncu --clock-control none -k regex:"gemv_q8_kernel|skinny_gemm_kernel" --launch-skip 4 --launch-count 4 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
        python3 benches/ncu_decode_gemv.py

Runs the q4k dp4a GEMV and the bf16 skinny GEMM on the Llama-3-8B o_proj [4096, 4096] and down [4096, 14336]
shapes at M = 1, each several times (the first launches warm up and are skipped), so the counters say what
limits the small shapes: achieved bandwidth, occupancy and why the warps stall.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import cuda, cuda_gguf
from candle_vllm.pyengine.quant.isq import quantize

SHAPES = [(4096, 4096), (4096, 14336)]


def main() -> None:
    dev = torch.device("cuda")
    for n, k in SHAPES:
        w = torch.randn(n, k, device=dev).to(torch.bfloat16)
        blocks = quantize(w, "q4k")
        x = torch.randn(1, k, device=dev).to(torch.bfloat16)
        for _ in range(6):
            cuda_gguf.gemv(x, blocks, QT.Q4_K, n, k)
        for warps in (4, 8):
            for _ in range(6):
                cuda.skinny_gemm(x, w, warps=warps)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
