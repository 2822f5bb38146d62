"""The floor for streaming one decode weight of the Llama-3-8B shapes: CUDA-graph replays of 20 launches, weights
rotated over >= 640 MB. Pure streaming kernels (benches/probe_stream_floor.cu), no math: bulk copies into a
shared-memory ring by 1 or 2 CTAs per SM (each CTA a contiguous equal share, with and without PDL between launches),
and plain 16-byte loads by many CTAs (with PDL as the decode GEMVs launch: the next grid triggered at entry, the
first loads in flight before the wait).

bf16 weights against cuBLASLt at M = 32 / 64 told how far a GEMM of our own could beat cuBLASLt at batch 64
(benches/RESULTS.md, 2026-12-03, session 22). --gguf streams each GGUF type's bytes of the four shapes instead (5-60
MB) and prints, per type and shape, the fastest stream's share of the copy ceiling: what any GEMV of that weight
could reach back to back, against issue 6's bar of 75 % (benches/RESULTS.md, session 56).

    nvcc -std=c++17 -O3 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a -I native \
        benches/probe_stream_floor.cu -o /tmp/probe_stream_floor.so
    python3 benches/probe_stream_floor.py /tmp/probe_stream_floor.so [--gguf [--ceiling-gbs 2960] [--json F]]
"""

import argparse
import ctypes
import json
from collections.abc import Callable

import torch

DEV = torch.device("cuda")
SHAPES = {"o": (4096, 4096), "qkv": (6144, 4096), "down": (4096, 14336), "gate_up": (28672, 4096)}
CEILING = 4.26e12  # bytes/s, the H200's copy ceiling (benches/RESULTS.md)


def load(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.probe_ring.argtypes = (ptr, i64, i32, i32, i32, i32, i32, ptr, ptr)
    lib.probe_ld.argtypes = (ptr, i64, i32, i32, i32, ptr, ptr)
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


def streams(lib: ctypes.CDLL, nbytes: int, sms: int, out: torch.Tensor,
            chunks: tuple[int, ...] = (32768, 16384)) -> dict[str, Callable[[torch.Tensor], None]]:
    """Each streaming variant as a launch on one weight copy of ``nbytes``: the ring (1 or 2 CTAs per SM, chunks of
    each size in ``chunks``, PDL or not) and plain loads (three grids, PDL or not)."""
    variants: dict[str, Callable[[torch.Tensor], None]] = {}

    def ring(grid: int, chunk: int, stages: int, pdl: int) -> Callable[[torch.Tensor], None]:
        def go(w: torch.Tensor) -> None:
            st = torch.cuda.current_stream().cuda_stream
            assert lib.probe_ring(w.data_ptr(), nbytes, grid, chunk, stages, 4, pdl, out.data_ptr(), st) == 0
        return go

    def plain(grid: int, threads: int, pdl: int) -> Callable[[torch.Tensor], None]:
        def go(w: torch.Tensor) -> None:
            st = torch.cuda.current_stream().cuda_stream
            assert lib.probe_ld(w.data_ptr(), nbytes, grid, threads, pdl, out.data_ptr(), st) == 0
        return go

    for pdl in (0, 1):
        for per_sm in (1, 2):
            for chunk in chunks:
                stages = (196608 // chunk) // per_sm
                variants[f"ring g{per_sm * sms} {chunk // 1024}Kx{stages} pdl{pdl}"] = ring(per_sm * sms, chunk,
                                                                                            stages, pdl)
        for grid, threads in ((sms * 4, 512), (sms * 8, 256), (sms * 16, 256)):
            variants[f"ld g{grid} t{threads} pdl{pdl}"] = plain(grid, threads, pdl)
    return variants


def copy_count(nbytes: int) -> int:
    """How many copies of an ``nbytes`` weight rotate over >= 640 MB (at least 3), so each launch reads HBM."""
    return max(3, -(-640 * 2**20 // nbytes))


def weight_copies(nbytes: int) -> list[torch.Tensor]:
    """copy_count(nbytes) copies of an ``nbytes`` weight of random bytes."""
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV) for _ in range(copy_count(nbytes))]


def shape_rows(lib: ctypes.CDLL, n: int, k: int, sms: int) -> dict[str, float]:
    """us per launch of cuBLASLt (M = 64, 32) and of each streaming variant on an [n, k] bf16 weight."""
    nbytes = n * k * 2
    copies = [torch.randn(n, k, device=DEV).to(torch.bfloat16) for _ in range(copy_count(nbytes))]
    x = torch.randn(64, k, device=DEV).to(torch.bfloat16)
    out = torch.zeros(4096, device=DEV)
    rows = {"cublas64": timed(lambda w: torch.mm(x, w.t()), copies),
            "cublas32": timed(lambda w: torch.mm(x[:32], w.t()), copies)}
    rows.update({key: timed(go, copies) for key, go in streams(lib, nbytes, sms, out).items()})
    return rows


def bf16_floor(lib: ctypes.CDLL, sms: int) -> None:
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        print(f"== {name} {n}x{k}: {nbytes / 1e6:.1f} MB, at 4.26 TB/s {nbytes / CEILING * 1e6:.2f} us")
        for key, us in shape_rows(lib, n, k, sms).items():
            print(f"  {key:32s} {us:8.2f} us  {nbytes / us / 1e6:6.3f} TB/s")
        torch.cuda.empty_cache()


def gguf_floor(lib: ctypes.CDLL, sms: int, ceiling: float, json_path: str | None) -> None:
    """Each GGUF type's bytes of the four shapes streamed by every variant; per type the fastest stream's share of
    ``ceiling`` (bytes/s) per shape, with and without PDL (types of equal size share their weights' timings)."""
    from bench_quant_cuda import TYPES  # benches/ is on the path when this runs as a script
    from gguf import GGML_QUANT_SIZES

    shapes = [SHAPES["o"], SHAPES["qkv"], SHAPES["down"], SHAPES["gate_up"]]
    out = torch.zeros(4096, device=DEV)
    by_bytes: dict[int, dict[str, float]] = {}
    result: dict[str, dict[str, dict[str, float]]] = {}
    print(f"SMs {sms}, ceiling {ceiling / 1e9:.0f} GB/s; best stream with PDL / without, % of the ceiling "
          f"(shapes {' / '.join(f'{n}x{k}' for n, k in shapes)})")
    for name, qtype in TYPES.items():
        elems, block = GGML_QUANT_SIZES[qtype]
        cells = []
        result[name] = {}
        for n, k in shapes:
            nbytes = n * k // elems * block
            if nbytes not in by_bytes:
                copies = weight_copies(nbytes)
                # 16 KB chunks only: within 4 % of 32 KB ones on every bf16 weight (session 22).
                variants = streams(lib, nbytes, sms, out, chunks=(16384,))
                by_bytes[nbytes] = {key: timed(go, copies) for key, go in variants.items()}
                del copies
                torch.cuda.empty_cache()
            rows = by_bytes[nbytes]
            result[name][f"{n}x{k}"] = {"bytes": nbytes, **rows}
            best = {pdl: min(us for key, us in rows.items() if key.endswith(f"pdl{pdl}")) for pdl in (0, 1)}
            cells.append(" / ".join(f"{100 * nbytes / (best[pdl] * 1e-6) / ceiling:.1f}" for pdl in (1, 0)))
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"sms": sms, "ceiling": ceiling, "types": result}, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("library", help="the built probe_stream_floor.so")
    ap.add_argument("--gguf", action="store_true", help="stream each GGUF type's bytes of the 8B shapes")
    ap.add_argument("--ceiling-gbs", type=float, default=CEILING / 1e9, help="the copy ceiling the shares are of")
    ap.add_argument("--json", help="--gguf: every variant's us per type and shape to this file")
    args = ap.parse_args()
    lib = load(args.library)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if args.gguf:
        gguf_floor(lib, sms, args.ceiling_gbs * 1e9, args.json)
    else:
        print(f"SMs {sms}")
        bf16_floor(lib, sms)


if __name__ == "__main__":
    main()
