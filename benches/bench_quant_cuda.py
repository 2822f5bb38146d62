"""GGUF CUDA kernels: fused dequantize + GEMV bandwidth per type and Llama-3-8B shape, and dequantize throughput.

    python benches/bench_quant_cuda.py                 # every type, the 8B shapes, M = 1 (and M = 8 for some)
    python benches/bench_quant_cuda.py --types q4k q8_0 --m 1 4 8 --kernels dp4a --json out.json
    python benches/bench_quant_cuda.py --variants                  # dp4a launch-variant sweep (see VARIANTS)
    python benches/bench_quant_cuda.py --variants base pdl,d1 pdl,r8,s3 --types q4k --m 1

Both GEMV kernels are timed where a type has them: "dp4a" (x rounded to int8 per 32 values, its own small
launch included in the time) and "mma" (f16/bf16 x on tensor cores).

Each figure is the median over graph replays of one launch per weight copy, the copies together several times
the 50 MB L2 so every launch streams its weight from HBM. The variant sweep times each dp4a launch variant
(cuda_gguf.Dp4aVariant, spelled as comma-separated tokens: pdl = quantizer as a programmatic dependent, rN rows
per CTA, tN threads, dN depth, sN shared-memory stages, cN CTAs per SM; "base" = all defaults) on the four 8B
shapes and the LM head, and ranks the variants per type and M by total time over the four 8B shapes. GB/s counts the quantized bytes read once (x and y are
negligible); the fraction is of the 4.26 TB/s copy ceiling. The bf16 skinny GEMM on the same shape is the dense
baseline (2 bytes per weight).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import cuda, cuda_gguf

CEILING_BYTES_PER_S = 4.26e12
TYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q8_0": QT.Q8_0, "q2k": QT.Q2_K,
         "q3k": QT.Q3_K, "q4k": QT.Q4_K, "q5k": QT.Q5_K, "q6k": QT.Q6_K}
SCALE_FIELDS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,), QT.Q2_K: (80, 82),
                QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LM_HEAD = (128256, 4096)
DEV = torch.device("cuda")


def random_blocks(qtype: QT, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks [n, row_bytes] on the GPU with sane f16 scales (random bytes elsewhere)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n, k // bs, ts), dtype=torch.uint8, device=DEV, generator=gen)
    for at in SCALE_FIELDS[qtype]:
        scale = (torch.rand(n, k // bs, device=DEV, generator=gen) * 0.75 + 0.25) / 32
        scale = torch.where(torch.rand(n, k // bs, device=DEV, generator=gen) < 0.5, -scale, scale)
        raw[:, :, at : at + 2] = scale.half().view(torch.uint8).view(n, k // bs, 2)
    return raw.view(n, -1)


def time_per_launch(launches: list[Callable[[], torch.Tensor]], replays: int = 20) -> float:
    """Median seconds per launch: one CUDA graph runs every launch once; replays are timed with events."""
    for f in launches:
        f()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in launches:
            f()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / len(launches))
    return statistics.median(times)


def copies_for(nbytes: int) -> int:
    return max(2, -(-256 * 2**20 // nbytes))


def weight_copies(qtype: QT, n: int, k: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Enough random copies of an [n, k] weight that a pass over them streams from HBM."""
    return [random_blocks(qtype, n, k, gen) for _ in range(copies_for(n * k // 2))]


def bench_gemv(
    qtype: QT,
    n: int,
    k: int,
    m: int,
    kernel: cuda_gguf.GemvKernel,
    gen: torch.Generator,
    w: list[torch.Tensor] | None = None,
    variant: cuda_gguf.Dp4aVariant | None = None,
) -> dict[str, float]:
    w = w if w is not None else weight_copies(qtype, n, k, gen)
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    sec = time_per_launch([lambda d=d: cuda_gguf.gemv(x, d, qtype, n, k, kernel=kernel, variant=variant) for d in w])
    nbytes = w[0].numel()
    return {"us": sec * 1e6, "gb_s": nbytes / sec / 1e9, "fraction": nbytes / sec / CEILING_BYTES_PER_S}


VARIANTS = [
    "base", "pdl", "pdl,d1", "pdl,d2",
    "pdl,r1,d1", "pdl,r2,d1", "pdl,r4,d1", "pdl,r8,d1", "pdl,r2,d2", "pdl,r4,d2",
    "pdl,s2", "pdl,s3", "pdl,s4", "pdl,r1,s3", "pdl,r4,s3",
    "pdl,t64,d1", "pdl,t256,d1", "pdl,t256,s3",
    "pdl,c1,d2", "pdl,c2,d2", "pdl,c4,d1", "pdl,c2,s3", "pdl,c4,s2",
]
VARIANT_KEYS = {"r": "rows", "t": "threads", "d": "depth", "s": "stages", "c": "ctas_per_sm"}


def parse_variant(spec: str) -> cuda_gguf.Dp4aVariant:
    """'pdl,r4,d1' -> Dp4aVariant(rows=4, depth=1, pdl_quantizer=True); 'base' -> the defaults."""
    fields: dict[str, int | bool] = {}
    for tok in spec.split(","):
        if tok in ("base", ""):
            continue
        if tok == "pdl":
            fields["pdl_quantizer"] = True
        elif tok[0] in VARIANT_KEYS and tok[1:].isdigit():
            fields[VARIANT_KEYS[tok[0]]] = int(tok[1:])
        else:
            raise SystemExit(f"bad variant token {tok!r} in {spec!r}: use base, pdl, rN, tN, dN, sN or cN")
    return cuda_gguf.Dp4aVariant(**fields)


def sweep_variants(specs: list[str], names: list[str], ms: list[int], gen: torch.Generator) -> list[dict[str, object]]:
    """Every variant on every shape (weights generated once per type and shape), then a ranking per type and M."""
    rows: list[dict[str, object]] = []
    shapes = [*SHAPES, LM_HEAD]
    for name in names:
        qtype = TYPES[name]
        if not cuda_gguf.dp4a_supported(qtype):
            raise SystemExit(f"{name} has no dp4a kernel to sweep")
        for n, k in shapes:
            w = weight_copies(qtype, n, k, gen)
            for m in ms:
                for spec in specs:
                    try:
                        r = bench_gemv(qtype, n, k, m, "dp4a", gen, w, parse_variant(spec))
                    except ValueError as exc:  # a combination that is not built (e.g. 8 rows at M = 8)
                        print(f"variant {name:5s} M={m} {spec:14s} {n:>6d}x{k:<6d} not built: {exc}", flush=True)
                        continue
                    rows.append({"kind": "variant", "variant": spec, "type": name, "n": n, "k": k, "m": m, **r})
                    print(f"variant {name:5s} M={m} {spec:14s} {n:>6d}x{k:<6d} {r['us']:9.2f} us"
                          f"  {100 * r['fraction']:5.1f} %", flush=True)
            del w
            torch.cuda.empty_cache()
    print("\nranking by total us over the four 8B shapes (then LM head):")
    for name in names:
        for m in ms:
            table = {}
            for r in rows:
                if r["type"] == name and r["m"] == m:
                    table.setdefault(r["variant"], {})[(r["n"], r["k"])] = r
            full = {v: t for v, t in table.items() if all(s in t for s in SHAPES)}
            for v in sorted(full, key=lambda v: sum(full[v][s]["us"] for s in SHAPES)):
                t = full[v]
                cells = "  ".join(f"{t[s]['us']:7.2f} us {100 * t[s]['fraction']:5.1f} %" for s in [*SHAPES, LM_HEAD] if s in t)
                print(f"{name:5s} M={m} {v:14s} total {sum(t[s]['us'] for s in SHAPES):8.2f} us | {cells}")
    return rows


def bench_dense(n: int, k: int, m: int, gen: torch.Generator) -> dict[str, float]:
    w = [torch.randn(n, k, device=DEV, dtype=torch.bfloat16, generator=gen) for _ in range(copies_for(2 * n * k))]
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    sec = time_per_launch([lambda d=d: cuda.skinny_gemm(x, d) for d in w])
    return {"us": sec * 1e6, "gb_s": 2 * n * k / sec / 1e9, "fraction": 2 * n * k / sec / CEILING_BYTES_PER_S}


def bench_dequant(qtype: QT, n: int, k: int, gen: torch.Generator) -> dict[str, float]:
    w = [random_blocks(qtype, n, k, gen) for _ in range(2)]
    sec = time_per_launch([lambda d=d: cuda_gguf.dequantize(d, qtype, n, k, torch.bfloat16) for d in w], replays=10)
    nbytes = w[0].numel() + 2 * n * k
    return {"us": sec * 1e6, "gb_s": nbytes / sec / 1e9, "fraction": nbytes / sec / CEILING_BYTES_PER_S}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=None, choices=list(TYPES), help="default: all (sweep: q4k q8_0 q4_0 q6k)")
    ap.add_argument("--m", nargs="+", type=int, default=None, help="activation rows (1..8); default 1 (sweep: 1 8)")
    ap.add_argument("--m8-types", nargs="*", default=["q4k", "q8_0", "q4_0"], help="types also timed at M = 8")
    ap.add_argument("--kernels", nargs="+", default=["dp4a", "mma"], choices=["dp4a", "mma"])
    ap.add_argument("--no-dequant", action="store_true", help="skip the dequantize throughput rows")
    ap.add_argument("--no-dense", action="store_true", help="skip the bf16 skinny-GEMM baseline rows")
    ap.add_argument("--variants", nargs="*", default=None, metavar="SPEC",
                    help="sweep dp4a launch variants instead (no SPEC: the VARIANTS list)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator(DEV).manual_seed(0)
    rows: list[dict[str, object]] = []
    if args.variants is not None:
        names = args.types or ["q4k", "q8_0", "q4_0", "q6k"]
        rows = sweep_variants(args.variants or VARIANTS, names, args.m or [1, 8], gen)
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=1))
        return
    args.types, args.m = args.types or list(TYPES), args.m or [1]

    def emit(kind: str, name: str, shape: tuple[int, int], m: int, r: dict[str, float]) -> None:
        rows.append({"kind": kind, "type": name, "n": shape[0], "k": shape[1], "m": m, **r})
        print(f"{kind:8s} {name:6s} {shape[0]:>6d}x{shape[1]:<6d} M={m}  {r['us']:9.2f} us  {r['gb_s']:7.0f} GB/s"
              f"  {100 * r['fraction']:5.1f} %", flush=True)

    for n, k in SHAPES if not args.no_dense else []:
        for m in sorted(set(args.m) | {8}):
            emit("bf16", "bf16", (n, k), m, bench_dense(n, k, m, gen))
    for name in args.types:
        qtype = TYPES[name]
        shapes = SHAPES + ([LM_HEAD] if qtype in (QT.Q6_K, QT.Q8_0) else [])
        kernels = [k for k in args.kernels if k == "mma" or cuda_gguf.dp4a_supported(qtype)]
        for kernel in kernels:
            for n, k in shapes:
                for m in sorted(set(args.m) | ({8} if name in args.m8_types else set())):
                    emit(kernel, name, (n, k), m, bench_gemv(qtype, n, k, m, kernel, gen))
        if not args.no_dequant:
            emit("dequant", name, (28672, 4096), 0, bench_dequant(qtype, 28672, 4096, gen))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
