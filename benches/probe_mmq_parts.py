"""Where the staged GGUF product's time goes at 2-8 tokens: its launches timed back to back in builds of
benches/probe_mmq_parts.cu that each leave one part out (the multiplying, the token loads, the store and the trigger
of the next grid before it) or take another chunk size. The difference from the whole kernel is what that part
costs on the critical path; a part whose removal saves nothing is hidden behind another. Needs only torch and gguf
(no module build): random weight bytes rotated over >= 640 MB, random codes and XBlocks. The builds that leave
nothing out must give the same bits (the last column), so a build that changes how the weights reach the warps is
checked as it is timed.

    for p in 0 1; do nvcc ... -DMMQ_STAGED_PROBE=$p benches/probe_mmq_parts.cu -o /tmp/probe_mmq_$p.so & done
    python3 benches/probe_mmq_parts.py whole=/tmp/probe_mmq_0.so "no multiply=/tmp/probe_mmq_1.so" \\
        --types q4_0 q4k --m 8 --warps 8 16

Session 58 checked that the whole kernel built this way times as the module's own launch (within 1 %).
"""

from __future__ import annotations

import argparse
import ctypes
import functools

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from probe_stream_floor import SHAPES, timed, weight_copies

TYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q8_0": QT.Q8_0, "q2k": QT.Q2_K,
         "q3k": QT.Q3_K, "q4k": QT.Q4_K, "q5k": QT.Q5_K, "q6k": QT.Q6_K}


def probe(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.probe_mmq.argtypes = (ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, ptr)
    lib.probe_part.restype = i32
    return lib


def tokens(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 codes [m, k] and their XBlocks (f32 scale, two int16 half sums) [m, k / 32]."""
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    xb = torch.randint(-(2**31), 2**31 - 1, (m, k // 32, 2), dtype=torch.int32, device="cuda")
    xb[:, :, 0] = (torch.rand(m, k // 32, device="cuda") * 0.01 + 0.01).view(torch.int32)
    return xq, xb


def cell(libs: list[ctypes.CDLL], name: str, n: int, k: int, m: int, warps: int) -> tuple[list[float], bool]:
    """us per launch of each probe build with ``warps`` warps on the same weights and codes, and whether the builds
    that leave nothing out (chunk sizes, copies and warp groups may differ) give the first one's bits: each warp
    takes the same units in the same order in all of them."""
    qtype = TYPES[name]
    elems, block = GGML_QUANT_SIZES[qtype]
    copies = weight_copies(n * k // elems * block)
    xq, xb = tokens(m, k)
    y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

    def launch(lib: ctypes.CDLL, w: torch.Tensor) -> None:
        stream = torch.cuda.current_stream().cuda_stream
        rc = lib.probe_mmq(y.data_ptr(), xq.data_ptr(), xb.data_ptr(), w.data_ptr(), m, n, k, int(qtype), warps,
                           stream)
        assert rc == 0, f"probe launch failed: CUDA error {rc}"

    times = [timed(functools.partial(launch, lib), copies) for lib in libs]
    outputs = []
    for lib in (lib for lib in libs if lib.probe_part() == 0):
        y.view(torch.int16).fill_(-1)  # a NaN no launch writes: rows a build leaves unwritten differ
        launch(lib, copies[0])
        outputs.append(y.view(torch.int16).clone())
    return times, all(torch.equal(out, outputs[0]) for out in outputs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("libraries", nargs="+", help="name=path of each probe_mmq_parts.cu build")
    ap.add_argument("--types", nargs="+", default=["q4_0", "q4k"], choices=list(TYPES))
    ap.add_argument("--m", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--shapes", nargs="+", default=["o"], choices=list(SHAPES),
                    help="probe_stream_floor.py's shape names (o: 4096x4096, qkv: 6144x4096, ...)")
    ap.add_argument("--warps", nargs="+", type=int, default=[8], help="warps per CTA (4, 8 or 16)")
    args = ap.parse_args()
    names = [spec.split("=", 1)[0] for spec in args.libraries]
    libs = [probe(spec.split("=", 1)[1]) for spec in args.libraries]
    print("| type | shape | M | warps | " + " | ".join(names) + " | whole builds' bits |")
    print("|---" * (5 + len(libs)) + "|")
    for name in args.types:
        for shape in args.shapes:
            n, k = SHAPES[shape]
            for m in args.m:
                for warps in args.warps:
                    us, same = cell(libs, name, n, k, m, warps)
                    bits = "same" if same else "DIFFER"
                    print(f"| {name} | {n}x{k} | {m} | {warps} | " + " | ".join(f"{u:.2f}" for u in us) +
                          f" | {bits} |", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
