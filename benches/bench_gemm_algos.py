"""Does a tuned cuBLASLt algorithm beat torch's GEMM for the decode linears? (issue 5, batch-64 decode)

Why: at M = 64 the Llama-3-8B decode linears run through torch (cuBLASLt preferred) at 65-87 % of HBM
bandwidth, and torch on CUDA cannot choose the algorithm. Before building start-up algorithm selection we
measure whether any algorithm cuBLASLt's own heuristic offers (up to --max-algos candidates, plus split-K
variants of the best few, checked with cublasLtMatmulAlgoCheck) is clearly faster. libcublasLt is called
directly through ctypes (the copy torch already loaded), so nothing beyond torch is needed on the GPU machine.

y = x @ W.T in bf16, W [N, K] row-major as torch stores it: in cuBLAS's column-major terms D[N, M] =
op_T(A[K, N]) @ B[K, M], the "TN" GEMM torch issues itself. Each candidate's output is compared with
torch's F.linear (max abs diff; beyond tolerance it is marked bad and never counted as best). Times are
medians over replays of a CUDA graph of many calls, the weights rotated over >= 512 MB so L2 cannot hold them.
"% peak" counts W + x + y bytes against 4.26 TB/s.

Run: ``python3 benches/bench_gemm_algos.py --quick [--json out.json] [--verbose]``
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

SHAPES: dict[str, tuple[int, int]] = {  # name -> (N, K) of W
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "lm_head": (128256, 4096),
}
PEAK_BPS = 4.26e12
ROTATE_BYTES = 512 << 20

# cublasLt.h constants
CUDA_R_32F, CUDA_R_16BF = 0, 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
DESC_TRANSA, DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
CFG_NAMES = {0: "id", 1: "tile", 2: "splitk", 3: "red", 4: "swz", 5: "opt", 6: "stages", 7: "inner", 8: "cluster"}
CFG_SPLITK, CFG_REDUCTION = 2, 3
REDUCTION_SCHEMES = (1, 2, 4)  # in place, compute type, output type


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves_count", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class BenchError(RuntimeError):
    """A setup step failed; the message says which and why."""


def find_cublaslt() -> str:
    """The libcublasLt torch loaded (so both use one library), else the nvidia-cublas wheel's copy."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1]
            if "libcublasLt.so" in path and os.path.exists(path):
                return path
    import site

    roots = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for root in roots:
        hits = sorted(glob.glob(os.path.join(root, "nvidia", "cu*", "lib", "libcublasLt.so*"))
                      + glob.glob(os.path.join(root, "nvidia", "cublas", "lib", "libcublasLt.so*")))
        if hits:
            return hits[-1]
    raise BenchError("libcublasLt not found: not loaded by torch and not under site-packages/nvidia/*/lib; "
                     "set CUBLASLT_PATH=/path/to/libcublasLt.so.13")


class CublasLt:
    """Thin checked ctypes binding of the cuBLASLt calls this benchmark needs."""

    def __init__(self, path: str) -> None:
        try:
            self.lib = ctypes.CDLL(path)
        except OSError as exc:
            raise BenchError(f"cannot load {path}: {exc}") from exc
        p, vp, i, sz = ctypes.POINTER, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        sigs: dict[str, list[Any]] = {
            "cublasLtCreate": [p(vp)],
            "cublasLtMatmulDescCreate": [p(vp), i, i],
            "cublasLtMatmulDescSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulDescDestroy": [vp],
            "cublasLtMatrixLayoutCreate": [p(vp), i, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [vp],
            "cublasLtMatmulPreferenceCreate": [p(vp)],
            "cublasLtMatmulPreferenceSetAttribute": [vp, i, vp, sz],
            "cublasLtMatmulPreferenceDestroy": [vp],
            "cublasLtMatmulAlgoGetHeuristic": [vp, vp, vp, vp, vp, vp, vp, i, p(HeuristicResult), p(i)],
            "cublasLtMatmulAlgoCheck": [vp, vp, vp, vp, vp, vp, p(Algo), p(HeuristicResult)],
            "cublasLtMatmulAlgoConfigGetAttribute": [p(Algo), i, vp, sz, p(sz)],
            "cublasLtMatmulAlgoConfigSetAttribute": [p(Algo), i, vp, sz],
            "cublasLtMatmul": [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, p(Algo), vp, sz, vp],
        }
        for name, args in sigs.items():
            fn = getattr(self.lib, name, None)
            if fn is None:
                raise BenchError(f"{path} lacks {name}")
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(self.lib.cublasLtGetVersion())
        status_string = getattr(self.lib, "cublasLtGetStatusString", None)
        if status_string is not None:
            status_string.argtypes, status_string.restype = [ctypes.c_int], ctypes.c_char_p
        self._status_string = status_string
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")

    def status(self, code: int) -> str:
        text = self._status_string(code).decode() if self._status_string is not None else ""
        return f"status {code} {text}".strip()

    def check(self, code: int, what: str) -> None:
        if code != 0:
            raise BenchError(f"{what} failed: {self.status(code)}")

    def describe(self, algo: Algo) -> str:
        """The algorithm's configuration attributes, for telling candidates apart in the report."""
        parts = []
        size = ctypes.c_size_t()
        for attr, name in CFG_NAMES.items():
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, None, 0,
                                                             ctypes.byref(size)) != 0 or size.value > 8:
                continue
            buf = ctypes.c_uint64(0)
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(buf),
                                                             size.value, ctypes.byref(size)) == 0:
                value = buf.value & ((1 << (8 * size.value)) - 1)
                parts.append(f"{name}={value}")
        return " ".join(parts)

    def set_config(self, algo: Algo, attr: int, value: int) -> bool:
        """Set a uint32 config attribute; False when this algorithm rejects it."""
        v = ctypes.c_uint32(value)
        return self.lib.cublasLtMatmulAlgoConfigSetAttribute(ctypes.byref(algo), attr, ctypes.byref(v), 4) == 0


@dataclass
class Candidate:
    """One cuBLASLt algorithm for one GEMM: where it came from, its workspace, and what it measured."""

    source: str  # "heur#i" or "heur#i/sk<n>r<scheme>"
    algo: Algo = field(repr=False)
    workspace: int
    desc: str = ""
    us: float = math.nan
    max_diff: float = math.nan
    error: str = ""


class LtGemm:
    """Descriptors for y[M, N] = x[M, K] @ W[N, K].T in bf16 with fp32 accumulation (the TN GEMM)."""

    def __init__(self, lt: CublasLt, m: int, n: int, k: int, workspace_bytes: int) -> None:
        self.lt, self.m, self.n, self.k = lt, m, n, k
        lib = lt.lib
        self.desc = ctypes.c_void_p()
        lt.check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F),
                 "cublasLtMatmulDescCreate")
        for attr, op in ((DESC_TRANSA, CUBLAS_OP_T), (DESC_TRANSB, CUBLAS_OP_N)):
            v = ctypes.c_int32(op)
            lt.check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(v), 4), "set trans")
        self.layouts = []
        for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):  # A = W (stored K x N), B = x, C = D = y
            layout = ctypes.c_void_p()
            lt.check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), CUDA_R_16BF, rows, cols, ld),
                     "cublasLtMatrixLayoutCreate")
            self.layouts.append(layout)
        self.pref = ctypes.c_void_p()
        lt.check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(self.pref)), "cublasLtMatmulPreferenceCreate")
        ws = ctypes.c_uint64(workspace_bytes)
        lt.check(lib.cublasLtMatmulPreferenceSetAttribute(self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8),
                 "set max workspace")
        self.workspace_bytes = workspace_bytes
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _abcd(self) -> tuple[ctypes.c_void_p, ...]:
        a, b, c = self.layouts
        return self.desc, a, b, c, c

    def heuristics(self, count: int) -> list[Candidate]:
        results = (HeuristicResult * count)()
        got = ctypes.c_int(0)
        code = self.lt.lib.cublasLtMatmulAlgoGetHeuristic(self.lt.handle, *self._abcd(), self.pref, count,
                                                          results, ctypes.byref(got))
        self.lt.check(code, f"cublasLtMatmulAlgoGetHeuristic(M={self.m}, N={self.n}, K={self.k})")
        out = []
        for i in range(got.value):
            r = results[i]
            if r.state != 0:
                continue
            algo = Algo.from_buffer_copy(r.algo)
            out.append(Candidate(f"heur#{i}", algo, int(r.workspace_size), self.lt.describe(algo)))
        return out

    def split_k_variant(self, base: Candidate, splits: int) -> Candidate | None:
        """`base` forced to `splits` K splits, with the first reduction scheme cuBLASLt accepts (or None)."""
        for scheme in REDUCTION_SCHEMES:
            algo = Algo.from_buffer_copy(base.algo)
            if not (self.lt.set_config(algo, CFG_SPLITK, splits) and self.lt.set_config(algo, CFG_REDUCTION, scheme)):
                return None
            result = HeuristicResult()
            code = self.lt.lib.cublasLtMatmulAlgoCheck(self.lt.handle, *self._abcd(), ctypes.byref(algo),
                                                       ctypes.byref(result))
            if code == 0 and result.workspace_size <= self.workspace_bytes:
                return Candidate(f"{base.source}/sk{splits}r{scheme}", algo, int(result.workspace_size),
                                 self.lt.describe(algo))
        return None

    def run(self, cand: Candidate, x_ptr: int, w_ptr: int, y_ptr: int, ws_ptr: int, stream: int) -> None:
        a, b, c = self.layouts
        code = self.lt.lib.cublasLtMatmul(
            self.lt.handle, self.desc, ctypes.byref(self.alpha), w_ptr, a, x_ptr, b, ctypes.byref(self.beta),
            y_ptr, c, y_ptr, c, ctypes.byref(cand.algo), ws_ptr, self.workspace_bytes, stream)
        self.lt.check(code, f"cublasLtMatmul {cand.source}")

    def close(self) -> None:
        lib = self.lt.lib
        lib.cublasLtMatmulPreferenceDestroy(self.pref)
        for layout in self.layouts:
            lib.cublasLtMatrixLayoutDestroy(layout)
        lib.cublasLtMatmulDescDestroy(self.desc)


def graph_us(fn: Callable[[int], object], calls: int, reps: int) -> float:
    """Median microseconds per fn(i), from replays of one CUDA graph of `calls` calls (no launch gaps)."""
    from bench_kernels import graph_seconds  # a sibling script: imports torch and the native module

    return 1e6 * graph_seconds(fn, calls, reps)


def lt_call(gemm: LtGemm, cand: Candidate, x: Any, weights: list[Any], y: Any, ws: Any) -> Callable[[int], None]:
    """Call i runs `cand` on weight copy i (rotating), on whatever stream is current (the capture stream too)."""
    import torch

    x_ptr, y_ptr, ws_ptr = x.data_ptr(), y.data_ptr(), ws.data_ptr()
    w_ptrs = [w.data_ptr() for w in weights]

    def call(i: int) -> None:
        gemm.run(cand, x_ptr, w_ptrs[i % len(w_ptrs)], y_ptr, ws_ptr, torch.cuda.current_stream().cuda_stream)

    return call


@dataclass
class Row:
    """One (shape, M) result line of the final table."""

    shape: str
    m: int
    n: int
    k: int
    torch_default_us: float
    torch_lt_us: float
    lt_heur0_us: float
    best_us: float
    best_source: str
    best_desc: str
    candidates: int
    bad: int
    failed: int
    max_diff_ok: float
    pct_peak_best: float
    speedup_vs_torch: float  # best torch (default or cuBLASLt) / best tuned
    detail: list[dict[str, Any]]


def bench_shape(lt: CublasLt, name: str, m_list: list[int], args: argparse.Namespace) -> list[Row]:
    import torch
    import torch.nn.functional as F

    n, k = SHAPES[name]
    dev = torch.device("cuda")
    copies = max(1, min(32, math.ceil(ROTATE_BYTES / (n * k * 2))))
    weights = []
    for _ in range(copies):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        weights.append(w.mul_(0.02))
    workspace = torch.empty(args.workspace_mb << 20, dtype=torch.uint8, device=dev)
    rows = []
    for m in m_list:
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        y = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        torch_us = {}
        outputs = {}
        for backend in ("cublas", "cublaslt"):
            torch.backends.cuda.preferred_blas_library(backend)
            outputs[backend] = F.linear(x, weights[0])
            torch_us[backend] = graph_us(lambda i, x=x: F.linear(x, weights[i % copies]), args.calls, args.reps)
        torch.backends.cuda.preferred_blas_library("cublaslt")
        ref = outputs["cublas"].float()
        tol = 1e-2 * ref.abs().max().item() + 1e-3
        lt_torch_diff = (outputs["cublaslt"].float() - ref).abs().max().item()
        gemm = LtGemm(lt, m, n, k, workspace.numel())
        try:
            try:
                cands = gemm.heuristics(args.max_algos)
            except BenchError as exc:
                print(f"{name} M={m}: {exc}", file=sys.stderr)
                cands = []
            seen = {bytes(c.algo) for c in cands}
            for base in cands[: args.splitk_top]:
                for splits in args.splitk:
                    var = gemm.split_k_variant(base, splits)
                    if var is not None and bytes(var.algo) not in seen:
                        seen.add(bytes(var.algo))
                        cands.append(var)
            for cand in cands:
                call = lt_call(gemm, cand, x, weights, y, workspace)
                try:
                    y.fill_(float("nan"))
                    call(0)
                    torch.cuda.synchronize()
                    cand.max_diff = (y.float() - ref).abs().max().item()
                    if not cand.max_diff <= tol:  # NaN (never written) counts as bad too
                        cand.error = f"bad result (max diff {cand.max_diff:.3g} > tol {tol:.3g})"
                        continue
                    cand.us = graph_us(call, args.calls, args.reps)
                except (BenchError, RuntimeError) as exc:
                    cand.error = str(exc).splitlines()[0][:160]
                    torch.cuda.synchronize()
        finally:
            gemm.close()
        ok = [c for c in cands if not c.error]
        best = min(ok, key=lambda c: c.us) if ok else None
        nbytes = 2 * (n * k + m * k + m * n)
        best_torch = min(torch_us.values())
        heur0 = next((c.us for c in cands if c.source == "heur#0" and not c.error), math.nan)
        row = Row(
            shape=name, m=m, n=n, k=k, torch_default_us=torch_us["cublas"], torch_lt_us=torch_us["cublaslt"],
            lt_heur0_us=heur0, best_us=best.us if best else math.nan, best_source=best.source if best else "-",
            best_desc=best.desc if best else "", candidates=len(cands),
            bad=sum(c.error.startswith("bad") for c in cands),
            failed=sum(bool(c.error) and not c.error.startswith("bad") for c in cands),
            max_diff_ok=max((c.max_diff for c in ok), default=math.nan),
            pct_peak_best=100 * nbytes / (best.us * 1e-6) / PEAK_BPS if best else math.nan,
            speedup_vs_torch=best_torch / best.us if best else math.nan,
            detail=[{"source": c.source, "desc": c.desc, "workspace": c.workspace, "us": c.us,
                     "max_diff": c.max_diff, "error": c.error} for c in cands],
        )
        rows.append(row)
        print(f"{name} [{n}, {k}] M={m}: torch cublas {torch_us['cublas']:.1f} us, cublaslt {torch_us['cublaslt']:.1f} us"
              f" (diff vs cublas {lt_torch_diff:.3g}); {len(cands)} Lt candidates ({row.bad} bad, {row.failed} failed,"
              f" max diff of good {row.max_diff_ok:.3g}, tol {tol:.3g}); best {row.best_us:.1f} us {row.best_source}"
              f" [{row.best_desc}]", flush=True)
        if args.verbose:
            for c in sorted(cands, key=lambda c: (bool(c.error), c.us)):
                state = c.error or f"{c.us:8.1f} us"
                print(f"    {c.source:<16} ws {c.workspace >> 10:>6} KiB  diff {c.max_diff:.3g}  {state}  [{c.desc}]")
    return rows


def print_table(rows: list[Row]) -> None:
    head = (f"{'shape':<9}{'M':>4}{'torch us':>10}{'lt us':>8}{'heur0 us':>10}{'best us':>9}{'%4.26TB/s':>10}"
            f"{'speed-up':>9}  best algorithm")
    print("\n" + head + "\n" + "-" * len(head))
    for r in rows:
        print(f"{r.shape:<9}{r.m:>4}{r.torch_default_us:>10.1f}{r.torch_lt_us:>8.1f}{r.lt_heur0_us:>10.1f}"
              f"{r.best_us:>9.1f}{r.pct_peak_best:>9.0f}%{r.speedup_vs_torch:>8.3f}x  {r.best_source} [{r.best_desc}]")
    print("torch us: F.linear with default cuBLAS; lt us: F.linear with preferred_blas_library('cublaslt'); heur0: "
          "cuBLASLt's first heuristic pick called here; speed-up: faster torch column / best tuned.")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="fewer candidates and replays (16 heuristic algos, split-K 2/4 on the top 2): ~1 min")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--ms", default="16,32,64,128", help="comma list of batch rows M")
    ap.add_argument("--max-algos", type=int, default=None, help="heuristic candidates asked for (default 32, quick 16)")
    ap.add_argument("--splitk", default=None, help="split-K counts tried on the top heuristic algos "
                                                   "(default 2,3,4,6,8; quick 2,4; '' for none)")
    ap.add_argument("--splitk-top", type=int, default=None, help="how many top heuristic algos get split-K variants "
                                                                 "(default 4, quick 2)")
    ap.add_argument("--workspace-mb", type=int, default=32, help="cuBLASLt workspace offered (MiB)")
    ap.add_argument("--calls", type=int, default=None, help="GEMMs per CUDA graph (default 20, quick 10)")
    ap.add_argument("--reps", type=int, default=None, help="graph replays, median taken (default 15, quick 7)")
    ap.add_argument("--json", default=None, help="write every row and candidate to this JSON file")
    ap.add_argument("--verbose", action="store_true", help="print every candidate's time, diff and config")
    args = ap.parse_args(argv)
    quick = args.quick
    defaults = {"max_algos": (16, 32), "splitk": ("2,4", "2,3,4,6,8"), "splitk_top": (2, 4), "calls": (10, 20),
                "reps": (7, 15)}
    for key, (q, full) in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, q if quick else full)
    try:
        args.shapes = [s for s in args.shapes.split(",") if s]
        args.ms = [int(v) for v in args.ms.split(",") if v]
        args.splitk = [int(v) for v in args.splitk.split(",") if v]
    except ValueError as exc:
        ap.error(f"--ms and --splitk take comma-separated integers ({exc})")
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        ap.error(f"unknown shape(s) {unknown}; choose from {', '.join(SHAPES)}")
    if not args.ms or min(args.ms) < 1 or any(s < 2 for s in args.splitk):
        ap.error("--ms needs positive integers and --splitk counts >= 2")
    if min(args.max_algos, args.calls, args.reps, args.workspace_mb) < 1 or args.splitk_top < 0:
        ap.error("--max-algos, --calls, --reps and --workspace-mb must be >= 1, --splitk-top >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("bench_gemm_algos: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    torch.backends.cuda.preferred_blas_library("cublaslt")
    a = torch.randn(64, 64, device="cuda", dtype=torch.bfloat16)
    F.linear(a, a)  # makes torch load and initialise cuBLAS/cuBLASLt before we look for the library
    torch.cuda.synchronize()
    try:
        path = os.environ.get("CUBLASLT_PATH") or find_cublaslt()
        lt = CublasLt(path)
    except BenchError as exc:
        print(f"bench_gemm_algos: {exc}", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | cuBLASLt {lt.version} at {path} | "
          f"workspace {args.workspace_mb} MiB | {args.max_algos} heuristic algos, split-K {args.splitk} on top "
          f"{args.splitk_top} | graph of {args.calls} calls x {args.reps} replays", flush=True)
    rows: list[Row] = []
    for name in args.shapes:
        try:
            rows.extend(bench_shape(lt, name, args.ms, args))
            torch.cuda.empty_cache()  # the shape's weight copies go before the next shape's arrive
        except BenchError as exc:
            print(f"bench_gemm_algos: {name}: {exc}", file=sys.stderr)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "cublaslt_version": lt.version, "args": vars(args), "rows": [asdict(r) for r in rows]},
                      f, indent=1, default=str)
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
