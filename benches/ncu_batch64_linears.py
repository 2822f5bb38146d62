r"""The Llama-3-8B decode linears at 64 tokens through torch (cuBLASLt), for Nsight Compute: is each GEMM bound by
DRAM or by L2? (issue 5, batch-64 decode)

    ncu --clock-control none -k regex:"nvjet|splitK|gemm|gemv" --section SpeedOfLight \
        --metrics lts__t_bytes.sum,dram__bytes_read.sum python3 benches/ncu_batch64_linears.py

At 64 tokens a tile of R weight rows reads 64 / R token bytes from L2 per weight byte, so the narrow weights (o_proj,
qkv, down) move about as many bytes through L2 as from DRAM; the profile says whether that, rather than DRAM, is
where cuBLASLt's o_proj (64 % of the copy ceiling) and qkv (72 %) stop. Each shape runs as the model runs it
(o_proj and down add into the residual, ``addmm_``), over three copies of its weight so that L2 starts cold.
"""

from __future__ import annotations

import torch

SHAPES = {"qkv": (6144, 4096, False), "o_proj": (4096, 4096, True), "gate_up": (28672, 4096, False),
          "down": (4096, 14336, True)}  # name -> (N, K, adds into the residual)
TOKENS, COPIES, CALLS = 64, 3, 6


def main() -> None:
    dev = torch.device("cuda")
    torch.backends.cuda.preferred_blas_library("cublaslt")  # as the engine sets it (engine_core.py)
    for name, (n, k, adds) in SHAPES.items():
        weights = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) for _ in range(COPIES)]
        x = torch.randn(TOKENS, k, device=dev, dtype=torch.bfloat16)
        out = torch.randn(TOKENS, n, device=dev, dtype=torch.bfloat16)
        for i in range(CALLS):
            w = weights[i % COPIES]
            if adds:
                out.addmm_(x, w.t())
            else:
                torch.mm(x, w.t(), out=out)
        torch.cuda.synchronize()
        print(name, tuple(out.shape), flush=True)


if __name__ == "__main__":
    main()
