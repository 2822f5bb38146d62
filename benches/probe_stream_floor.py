"""The floor for streaming one decode weight of the Llama-3-8B shapes, against cuBLASLt at M = 32 / 64: CUDA-graph
replays of 20 launches, weights rotated over >= 640 MB. Pure streaming kernels (benches/probe_stream_floor.cu), no
math: bulk copies into a shared-memory ring by 1 or 2 CTAs per SM (each CTA a contiguous equal share, with and
without PDL between launches), and plain 16-byte loads by many CTAs. It told how far a GEMM of our own could beat
cuBLASLt at batch 64 (benches/RESULTS.md, 2026-12-03, session 22).

    nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -I native \
        benches/probe_stream_floor.cu -o /tmp/probe_stream_floor.so
    python3 benches/probe_stream_floor.py /tmp/probe_stream_floor.so
"""

import ctypes
import sys
from collections.abc import Callable

import torch

DEV = torch.device("cuda")
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
CEILING = 4.26e12  # bytes/s, the H200's copy ceiling (benches/RESULTS.md)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.probe_ring.argtypes = (ptr, i64, i32, i32, i32, i32, i32, ptr, ptr)
    lib.probe_ld.argtypes = (ptr, i64, i32, i32, ptr, ptr)
    return lib


def timed(fn: Callable[[torch.Tensor], object], copies: list[torch.Tensor], launches: int = 20) -> float:
    """Best-of-3 us per launch over 10 replays of a graph of `launches` calls, each on the next weight copy."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for i in range(3):
            fn(copies[i % len(copies)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(launches):
            fn(copies[i % len(copies)])
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / (10 * launches))
    return best


def shape_rows(lib: ctypes.CDLL, n: int, k: int, sms: int) -> dict[str, float]:
    """us per launch of cuBLASLt (M = 64, 32) and of each streaming variant on an [n, k] bf16 weight."""
    nbytes = n * k * 2
    copies = [torch.randn(n, k, device=DEV).to(torch.bfloat16) for _ in range(max(3, -(-640 * 2**20 // nbytes)))]
    x = torch.randn(64, k, device=DEV).to(torch.bfloat16)
    out = torch.zeros(4096, device=DEV)
    rows = {"cublas64": timed(lambda w: torch.mm(x, w.t()), copies),
            "cublas32": timed(lambda w: torch.mm(x[:32], w.t()), copies)}

    def ring(grid: int, chunk: int, stages: int, pdl: int) -> Callable[[torch.Tensor], None]:
        def go(w: torch.Tensor) -> None:
            st = torch.cuda.current_stream().cuda_stream
            assert lib.probe_ring(w.data_ptr(), nbytes, grid, chunk, stages, 4, pdl, out.data_ptr(), st) == 0
        return go

    def plain(grid: int, threads: int) -> Callable[[torch.Tensor], None]:
        def go(w: torch.Tensor) -> None:
            st = torch.cuda.current_stream().cuda_stream
            assert lib.probe_ld(w.data_ptr(), nbytes, grid, threads, out.data_ptr(), st) == 0
        return go

    for per_sm in (1, 2):
        for chunk, stages in ((32768, 6 // per_sm), (16384, 12 // per_sm)):
            for pdl in (0, 1):
                rows[f"ring g{per_sm * sms} {chunk // 1024}Kx{stages} pdl{pdl}"] = timed(
                    ring(per_sm * sms, chunk, stages, pdl), copies)
    for grid, threads in ((sms * 4, 512), (sms * 8, 256), (sms * 16, 256)):
        rows[f"ld g{grid} t{threads}"] = timed(plain(grid, threads), copies)
    return rows


def main() -> None:
    lib = load(sys.argv[1])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"SMs {sms}")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        print(f"== {name} {n}x{k}: {nbytes / 1e6:.1f} MB, at 4.26 TB/s {nbytes / CEILING * 1e6:.2f} us")
        for key, us in shape_rows(lib, n, k, sms).items():
            print(f"  {key:32s} {us:8.2f} us  {nbytes / us / 1e6:6.3f} TB/s")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
