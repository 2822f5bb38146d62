"""GGUF CUDA kernels: fused dequantize + GEMV bandwidth per type and Llama-3-8B shape, and dequantize throughput.

    python benches/bench_quant_cuda.py                 # every type, the 8B shapes, M = 1 (and M = 8 for some)
    python benches/bench_quant_cuda.py --types q4k q8_0 --m 1 4 8 --kernels dp4a --json out.json
    python benches/bench_quant_cuda.py --sweep-rows    # dp4a at M = 1: every rows-per-CTA launch
    python benches/bench_quant_cuda.py --sweep-rows --m 2 4 8 --codes --types q4_0 q8_0   # several tokens

Both GEMV kernels are timed where a type has them: "dp4a" (x rounded to int8 per 32 values, its own small
launch included in the time, or with --codes the codes written beforehand, as the decode path's RMSNorm and SiLU
kernels write them for the q/k/v, gate/up and down projections) and "mma" (f16/bf16 x on tensor cores).

Each figure is the median over graph replays of one launch per weight copy, the copies together several times
the 50 MB L2 so every launch streams its weight from HBM. GB/s counts the quantized bytes read once (x and y are
negligible); the fraction is of the 4.26 TB/s copy ceiling. The bf16 skinny GEMM on the same shape is the dense
baseline (2 bytes per weight).

"mmq" (--kernels mmq) is the int8 tensor-core product for decode batches up to 32 rows (x rounded as for dp4a,
its quantizer launch included; --mmq-row-tiles / --mmq-warps / --mmq-staging time its launch choices, the last
its two kernels: weights in flight in registers or streamed through shared memory); dp4a and mma run batches
above 8 rows in 8-row passes, as ops.quant does.

--behind-norm launches each GEMV right behind the RMSNorm that writes its activations and subtracts the norm's time
(timed alone): in a decode step a kernel that streams its weights through shared memory starts filling its ring
while the kernel before it runs (programmatic dependent launch), which back-to-back launches of one GEMV, each
waiting for the last one's end, leave out. (Session 54 found back-to-back figures and decode at odds on two staged
layouts, RESULTS.md; this mode is there to tell whether that overlap is why.)

--sweep-rows times the dp4a GEMV at each --m for every launch choice (weight rows per CTA 2/4/8, 2/4 from three
tokens; all give the same bits) on the four 8B shapes, marks the default launch, prints the best per (type, tokens,
shape) and what the best choices would save per Llama-3-8B decode step (32 layers of the four shapes).
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import cuda, cuda_gguf, native
from candle_vllm.pyengine.ops.norm import rms_norm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation

CEILING_BYTES_PER_S = 4.26e12
TYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q8_0": QT.Q8_0, "q2k": QT.Q2_K,
         "q3k": QT.Q3_K, "q4k": QT.Q4_K, "q5k": QT.Q5_K, "q6k": QT.Q6_K}
SCALE_FIELDS = {QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,), QT.Q2_K: (80, 82),
                QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,)}
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
SWEEP_TYPES = ["q4k", "q5k", "q4_0", "q8_0", "q6k"]
LAYERS_8B = 32
LM_HEAD = (128256, 4096)
DEV = torch.device("cuda")
STAGING_LABELS = {0: "auto", 1: "reg", 2: "smem"}


def random_blocks(qtype: QT, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random GGUF blocks on the GPU with sane f16 scales (random bytes elsewhere), [n, row bytes] in the layout the
    CUDA kernels read (``cuda_gguf.device_layout``)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    raw = torch.randint(0, 256, (n, k // bs, ts), dtype=torch.uint8, device=DEV, generator=gen)
    for at in SCALE_FIELDS[qtype]:
        scale = (torch.rand(n, k // bs, device=DEV, generator=gen) * 0.75 + 0.25) / 32
        scale = torch.where(torch.rand(n, k // bs, device=DEV, generator=gen) < 0.5, -scale, scale)
        raw[:, :, at : at + 2] = scale.half().view(torch.uint8).view(n, k // bs, 2)
    return cuda_gguf.device_layout(raw.view(n, -1), qtype, n, k).view(n, -1)


def time_per_launch(launches: list[Callable[[], object]], replays: int = 20) -> float:
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


Activations = torch.Tensor | Q8Activation


def bench_gemv(
    qtype: QT, n: int, k: int, m: int, kernel: Literal["dp4a", "mma", "mmq"], gen: torch.Generator,
    row_tiles: int = 0, warps: int = 0, codes: bool = False, staging: int = 0, behind_norm: bool = False,
) -> dict[str, float]:
    """One GEMV kernel: "dp4a" / "mma" (above 8 rows in 8-row passes, as ops.quant runs them) or "mmq" (with
    ``row_tiles`` 16-row tiles, ``warps`` warps per CTA and ``staging`` its kernel, 0 = its default rules); ``codes``:
    the int8 kernels read codes an RMSNorm wrote before the timed graph (no quantizer launch), of the scale group the
    kernel takes; ``behind_norm``: every launch reads what an RMSNorm launched just before it wrote (codes, or bf16
    for "mma"), as in a decode step, where a kernel that streams its weights can start on them while the norm runs
    (programmatic dependent launch); the norm's own time, timed alone, is subtracted."""
    w = [random_blocks(qtype, n, k, gen) for _ in range(copies_for(n * k // 2))]
    dense = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
    norm_weight = torch.ones(k, device=DEV, dtype=torch.bfloat16)
    group = 0 if kernel == "mma" else cuda_gguf.x_group(qtype) if kernel == "mmq" else 32

    def normed() -> Activations:
        out = rms_norm(dense, norm_weight, 1e-5, q8=group)
        assert group == 0 or isinstance(out, Q8Activation), "RMSNorm wrote no int8 codes for this shape"
        return out

    def run(x: Activations, d: torch.Tensor) -> object:
        if kernel == "mmq":
            return cuda_gguf.mmq(x, d, qtype, n, k, row_tiles=row_tiles, warps=warps, staging=staging)
        parts = ([x.row_slice(i, i + 8) for i in range(0, m, 8)] if isinstance(x, Q8Activation)
                 else [x[i : i + 8] for i in range(0, m, 8)])
        return [cuda_gguf.gemv(p, d, qtype, n, k, kernel=kernel) for p in parts]

    if behind_norm:
        return figures(w, lambda d: run(normed(), d), before=normed)
    x = normed() if codes and kernel != "mma" else dense
    return figures(w, lambda d: run(x, d))


def figures(w: list[torch.Tensor], launch: Callable[[torch.Tensor], object],
            before: Callable[[], object] | None = None) -> dict[str, float]:
    """us / GB/s / fraction of one launch(weight) over the weight copies ``w``, less the time of ``before`` (a
    kernel each launch runs first, timed alone as often)."""
    sec = time_per_launch([lambda d=d: launch(d) for d in w])
    if before is not None:
        sec -= time_per_launch([before] * len(w))
    nbytes = w[0].numel()
    return {"us": sec * 1e6, "gb_s": nbytes / sec / 1e9, "fraction": nbytes / sec / CEILING_BYTES_PER_S}



def row_choices(m: int) -> tuple[int, ...]:
    """The dp4a launch's rows-per-CTA choices for ``m`` tokens (8 only for one or two)."""
    return (2, 4, 8) if m <= 2 else (2, 4)


def sweep_rows(names: list[str], ms: list[int], codes: bool, gen: torch.Generator) -> list[dict[str, Any]]:
    """Every dp4a launch choice (rows per CTA) per type, token count and 8B shape, on the same weight copies;
    ``codes``: the GEMV reads int8 codes an RMSNorm wrote beforehand (no quantizer launch), as in decode."""
    rows: list[dict[str, Any]] = []
    print(f"{'type':6s} {'M':>2s} {'shape':>12s} {'rows':>4s} {'us':>9s} {'GB/s':>7s} {'%':>6s}")
    for name in names:
        qtype = TYPES[name]
        if not cuda_gguf.dp4a_supported(qtype):
            print(f"{name}: no dp4a kernel, skipped")
            continue
        for n, k in SHAPES:
            w = [random_blocks(qtype, n, k, gen) for _ in range(copies_for(n * k // 2))]
            for m in ms:
                dense = torch.randn(m, k, device=DEV, dtype=torch.bfloat16, generator=gen)
                x = rms_norm(dense, torch.ones(k, device=DEV, dtype=torch.bfloat16), 1e-5, q8=32) if codes else dense
                default = cuda_gguf.gemv_rows(qtype, m, n, k)
                for r in row_choices(m):
                    fig = figures(w, lambda d, r=r, x=x, q=qtype, n=n, k=k: cuda_gguf.gemv(x, d, q, n, k,
                                                                                          kernel="dp4a", rows=r))
                    row = {"type": name, "m": m, "n": n, "k": k, "rows": r, "default": r == default, **fig}
                    rows.append(row)
                    print(f"{name:6s} {m:>2d} {n:>6d}x{k:<5d} {r:>4d} {fig['us']:9.2f} {fig['gb_s']:7.0f}"
                          f" {100 * fig['fraction']:5.1f}%{'  default' if row['default'] else ''}", flush=True)
            del w
    print_sweep_summary(rows)
    return rows


def print_sweep_summary(rows: list[dict[str, Any]]) -> None:
    """Best launch per (type, tokens, shape) against the default, and the 8B decode step's GEMV time both ways."""
    print("\nbest per (type, tokens, shape):")
    step: dict[tuple[str, int], list[float]] = {}
    for name, m in dict.fromkeys((str(r["type"]), int(r["m"])) for r in rows):
        for n, k in SHAPES:
            cands = [r for r in rows if (r["type"], r["m"], r["n"], r["k"]) == (name, m, n, k)]
            if not cands:
                continue
            best = min(cands, key=lambda r: float(r["us"]))
            default = next(r for r in cands if r["default"])
            b_us, d_us = float(best["us"]), float(default["us"])
            print(f"{name:6s} M={m} {n:>6d}x{k:<5d} best rows={best['rows']}: {b_us:8.2f} us"
                  f" ({100 * float(best['fraction']):5.1f} %), default rows={default['rows']}: {d_us:8.2f} us"
                  f" ({100 * float(default['fraction']):5.1f} %), x{d_us / b_us:.3f}")
            totals = step.setdefault((name, m), [0.0, 0.0])
            totals[0] += LAYERS_8B * d_us
            totals[1] += LAYERS_8B * b_us
    for (name, m), (d_total, b_total) in step.items():
        print(f"{name:6s} M={m} 8B decode step GEMVs ({LAYERS_8B} layers, 4 shapes): default {d_total / 1e3:.3f} ms, "
              f"best per shape {b_total / 1e3:.3f} ms (saves {(d_total - b_total) / 1e3:.3f} ms)")


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
    ap.add_argument("--types", nargs="+", default=None, choices=list(TYPES),
                    help=f"default: all ({' '.join(SWEEP_TYPES)} with --sweep-rows)")
    ap.add_argument("--m", nargs="+", type=int, default=[1],
                    help="activation rows (dp4a/mma above 8 in 8-row passes; mmq up to 32)")
    ap.add_argument("--m8-types", nargs="*", default=["q4k", "q8_0", "q4_0"], help="types also timed at M = 8")
    ap.add_argument("--kernels", nargs="+", default=["dp4a", "mma"], choices=["dp4a", "mma", "mmq"])
    ap.add_argument("--mmq-row-tiles", nargs="+", type=int, default=[0],
                    help="mmq launches to time: 16-row tiles per CTA (1, 2; 0 = default rule)")
    ap.add_argument("--mmq-warps", nargs="+", type=int, default=[0],
                    help="mmq launches to time: warps per CTA splitting K (4, 8, 16 with one row tile; 0 = default rule)")
    ap.add_argument("--mmq-staging", nargs="+", type=int, default=[0],
                    help="mmq kernels to time: 1 weights in flight in registers, 2 streamed through shared memory "
                         "(up to 8 rows, Hopper); 0 = default rule")
    ap.add_argument("--codes", action="store_true",
                    help="dp4a/mmq on int8 codes written beforehand (as the decode path's producers write them)")
    ap.add_argument("--behind-norm", action="store_true",
                    help="each GEMV launch behind the RMSNorm that writes its activations, as in decode (the norm's "
                         "time, timed alone, subtracted): weights the kernel streams while the norm runs count")
    ap.add_argument("--no-dequant", action="store_true", help="skip the dequantize throughput rows")
    ap.add_argument("--no-dense", action="store_true", help="skip the bf16 skinny-GEMM baseline rows")
    ap.add_argument("--sweep-rows", action="store_true",
                    help="only the dp4a launch choices (rows per CTA) at each --m (up to 8) on the 8B shapes")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    gen = torch.Generator(DEV).manual_seed(0)
    if args.sweep_rows:
        swept = sweep_rows(args.types or SWEEP_TYPES, args.m, args.codes, gen)
        if args.json:
            Path(args.json).write_text(json.dumps(swept, indent=1))
        return
    args.types = args.types or list(TYPES)
    rows: list[dict[str, Any]] = []

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
        kernels = [k for k in args.kernels if k == "mma" or (k == "dp4a" and cuda_gguf.dp4a_supported(qtype))
                   or (k == "mmq" and native.loaded().cuda_gguf_mmq_supported(int(qtype)))]
        for kernel in kernels:
            for n, k in shapes:
                for m in sorted(set(args.m) | ({8} if name in args.m8_types else set())):
                    launches = ([(rt, ws, st) for rt in args.mmq_row_tiles for ws in args.mmq_warps
                                 for st in args.mmq_staging if st != 2 or (m <= 8 and rt == 0)]
                                if kernel == "mmq" else [(0, 0, 0)])
                    for rt, ws, st in launches:
                        label = (f"mmq/{rt or 'auto'}x{ws or 'auto'}/{STAGING_LABELS[st]}" if kernel == "mmq"
                                 else kernel)
                        emit(label, name, (n, k), m,
                             bench_gemv(qtype, n, k, m, kernel, gen, rt, ws, args.codes, st, args.behind_norm))
        if not args.no_dequant:
            emit("dequant", name, (28672, 4096), 0, bench_dequant(qtype, 28672, 4096, gen))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
