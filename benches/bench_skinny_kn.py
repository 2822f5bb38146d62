"""The decode GEMM over [K, N] weights (``ops.cuda_kn.skinny_gemm_kn``) against skinny_gemm ([N, K]) and cuBLAS on
either layout, on the Llama-3-8B decode shapes: every launch setting (splits, warps, slabs per stage) checked against
an fp64 matmul, then timed (CUDA-graph replays of 20 launches, weights rotated over >= 512 MB), with the default
launch and the best setting per cell. It tunes ``cuda_kn.skinny_gemm_kn_launch``. Session 30's probe kernel, which
found the layout and load scheme, became native/cuda/skinny_gemm_kn.cu (benches/RESULTS.md, session 30).

    python3 benches/bench_skinny_kn.py [--m 1 4 8 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import torch.nn.functional as F
from bench_kernels import copies_for, graph_seconds  # a sibling script (benches/ is sys.path[0])

from candle_vllm.pyengine.ops import cuda, cuda_kn

DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CEILING = 4.26e12  # bytes/s, the H200's copy ceiling (benches/RESULTS.md)
SETTINGS = list(itertools.product((1, 2, 4, 6, 8, 12, 16), (4, 8), (1, 2, 4)))  # splits, warps, slabs per stage


def cell(name: str, n: int, k: int, m: int, w_nk: list[torch.Tensor], w_kn: list[torch.Tensor]) -> dict:
    """One shape and token count: the default launch and the best setting against skinny_gemm and cuBLAS, us."""
    copies = len(w_nk)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    want = x.double() @ w_kn[0].double()
    best: tuple[float, tuple[int, int, int] | None] = (float("inf"), None)
    for splits, warps, stage in SETTINGS:
        got = cuda_kn.skinny_gemm_kn(x, w_kn[0], splits=splits, warps=warps, stage_slabs=stage)
        err = ((got.double() - want).norm() / want.norm()).item()
        if err > 1e-2:
            raise AssertionError(f"{name} M={m} {(splits, warps, stage)}: relative error {err:.2e}")
        def launch(i: int, s: int = splits, w: int = warps, st: int = stage) -> torch.Tensor:
            return cuda_kn.skinny_gemm_kn(x, w_kn[i % copies], splits=s, warps=w, stage_slabs=st)

        t = graph_seconds(launch)
        best = min(best, (t, (splits, warps, stage)), key=lambda b: b[0])
    default = graph_seconds(lambda i: cuda_kn.skinny_gemm_kn(x, w_kn[i % copies]))
    skinny = graph_seconds(lambda i: cuda.skinny_gemm(x, w_nk[i % copies]))
    nn = graph_seconds(lambda i: torch.matmul(x, w_kn[i % copies]))
    tn = graph_seconds(lambda i: F.linear(x, w_nk[i % copies]))
    nbytes = n * k * 2
    row = dict(shape=f"{name} {n}x{k}", m=m, default_us=default * 1e6, best_us=best[0] * 1e6, best_setting=best[1],
               skinny_us=skinny * 1e6, cublas_nn_us=nn * 1e6, cublas_tn_us=tn * 1e6,
               best_pct=100 * nbytes / best[0] / CEILING, skinny_pct=100 * nbytes / skinny / CEILING)
    print(f"{row['shape']:<22}{m:>3}  default {row['default_us']:7.2f}  best {row['best_us']:7.2f} us "
          f"({row['best_pct']:5.1f} %) {best[1]}  skinny {row['skinny_us']:7.2f} ({row['skinny_pct']:5.1f} %)  "
          f"cuBLAS NN {row['cublas_nn_us']:7.2f}  TN {row['cublas_tn_us']:7.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = copies_for(n * k * 2)
        w_nk = [torch.randn(n, k, device=DEV).to(torch.bfloat16) for _ in range(copies)]
        w_kn = [w.t().contiguous() for w in w_nk]
        rows += [cell(name, n, k, m, w_nk, w_kn) for m in args.m]
        del w_nk, w_kn
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
