"""Can a batch 1-16 GEMV stream a bf16 weight stored [K, N] as fast as skinny_gemm streams [N, K]? The probe
kernel (benches/probe_kn_gemv.cu) against skinny_gemm (our decode kernel, [N, K]) and cuBLAS on either layout, on the
Llama-3-8B decode shapes: CUDA-graph replays of 20 launches, weights rotated over >= 512 MB. Every probe launch
setting (splits, warps, 16-byte runs per lane, slabs in flight) is checked against an fp64 matmul, then timed; the
best per cell is reported (benches/RESULTS.md, session 30).

    nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -I native \\
        benches/probe_kn_gemv.cu -o /tmp/probe_kn_gemv.so
    python3 benches/probe_kn_gemv.py /tmp/probe_kn_gemv.so [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import itertools
import json

import torch
import torch.nn.functional as F
from bench_kernels import copies_for, graph_seconds  # a sibling script (benches/ is sys.path[0])

from candle_vllm.pyengine.ops import cuda

DEV = torch.device("cuda")
SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
CEILING = 4.26e12  # bytes/s, the H200's copy ceiling (benches/RESULTS.md)
# splits, warps, 16-byte runs per lane and row, slabs per stage, next stage loaded before the multiply (1) or not
SETTINGS = list(itertools.product((1, 2, 4, 8, 16), (4, 8), (1, 2), (1, 2, 4), (0, 1)))


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.probe_kn_gemv.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int] * 8 + [ctypes.c_void_p]
    return lib


def probe(lib: ctypes.CDLL, y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, work: tuple[torch.Tensor, torch.Tensor],
          setting: tuple[int, ...]) -> None:
    splits, warps, kv, ku, pipe = setting
    m, k = x.shape
    rc = lib.probe_kn_gemv(y.data_ptr(), x.data_ptr(), w.data_ptr(), work[0].data_ptr(), work[1].data_ptr(), m,
                           w.shape[1], k, splits, warps, kv, ku, pipe, torch.cuda.current_stream().cuda_stream)
    if rc != 0:
        raise RuntimeError(f"probe_kn_gemv {setting}: {rc}")


def cell(lib: ctypes.CDLL, name: str, n: int, k: int, m: int, w_nk: list[torch.Tensor],
         w_kn: list[torch.Tensor]) -> dict:
    """One shape and token count: the best probe setting against skinny_gemm and cuBLAS, us."""
    copies = len(w_nk)
    x = torch.randn(m, k, device=DEV).to(torch.bfloat16)
    y = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    work = (torch.empty(16 * m * n, device=DEV), torch.zeros(n // 64, device=DEV, dtype=torch.int32))
    want = x.double() @ w_kn[0].double()
    best: tuple[float, tuple[int, ...] | None] = (float("inf"), None)
    for setting in SETTINGS:
        probe(lib, y, x, w_kn[0], work, setting)
        err = ((y.double() - want).norm() / want.norm()).item()
        if err > 1e-2:
            raise AssertionError(f"{name} M={m} {setting}: relative error {err:.2e}")
        t = graph_seconds(lambda i, s=setting: probe(lib, y, x, w_kn[i % copies], work, s))
        best = min(best, (t, setting), key=lambda b: b[0])
    skinny = graph_seconds(lambda i: cuda.skinny_gemm(x, w_nk[i % copies]))
    nn = graph_seconds(lambda i: torch.matmul(x, w_kn[i % copies]))
    tn = graph_seconds(lambda i: F.linear(x, w_nk[i % copies]))
    nbytes = n * k * 2
    row = dict(shape=f"{name} {n}x{k}", m=m, probe_us=best[0] * 1e6, probe_setting=best[1], skinny_us=skinny * 1e6,
               cublas_nn_us=nn * 1e6, cublas_tn_us=tn * 1e6, probe_pct=100 * nbytes / best[0] / CEILING,
               skinny_pct=100 * nbytes / skinny / CEILING)
    print(f"{row['shape']:<22}{m:>3}  probe {row['probe_us']:7.2f} us ({row['probe_pct']:5.1f} %) {best[1]}  "
          f"skinny {row['skinny_us']:7.2f} ({row['skinny_pct']:5.1f} %)  cuBLAS NN {row['cublas_nn_us']:7.2f}  "
          f"TN {row['cublas_tn_us']:7.2f}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("lib")
    ap.add_argument("--m", nargs="+", type=int, default=[1, 4, 8, 16])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    lib = load(args.lib)
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = copies_for(n * k * 2)
        w_nk = [torch.randn(n, k, device=DEV).to(torch.bfloat16) for _ in range(copies)]
        w_kn = [w.t().contiguous() for w in w_nk]
        rows += [cell(lib, name, n, k, m, w_nk, w_kn) for m in args.m]
        del w_nk, w_kn
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
