"""Where the staged GGUF product's time goes at 2-8 tokens: its launches timed back to back in builds of
benches/probe_mmq_parts.cu that each leave one part out (the multiplying, the token loads, the store and the trigger
of the next grid before it) or take another chunk size. The difference from the whole kernel is what that part
costs on the critical path; a part whose removal saves nothing is hidden behind another. Needs only torch and gguf
(no module build): random weight bytes rotated over >= 640 MB, random codes and XBlocks. The builds that leave
nothing out must give the same bits (the last column), so a build that changes how the weights reach the warps is
checked as it is timed. A build with -DMMQ_STAGED_PROBE_TIMELINE also prints, per cell, when its CTAs saw each chunk
land and finished multiplying (SM cycles from their start): how much multiplying is left after the last bytes.

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

TIMELINE_CTAS, TIMELINE_SLOTS = 1024, 35  # gguf_mmq_staged.cu kTimelineCtas, kTimelineSlots
CHUNK_SLOTS, END_SLOT, WAITED_SLOT = range(1, 33), 33, 34
TYPES = {"q4_0": QT.Q4_0, "q4_1": QT.Q4_1, "q5_0": QT.Q5_0, "q5_1": QT.Q5_1, "q8_0": QT.Q8_0, "q2k": QT.Q2_K,
         "q3k": QT.Q3_K, "q4k": QT.Q4_K, "q5k": QT.Q5_K, "q6k": QT.Q6_K}


def probe(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.probe_mmq.argtypes = (ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, ptr)
    lib.probe_part.restype = i32
    return lib


def timeline(lib: ctypes.CDLL) -> str | None:
    """A timeline build's (MMQ_STAGED_PROBE_TIMELINE) marks of its launches since the last call, summed up: thousands
    of SM cycles from a CTA's start until its warp 0's wait for the kernel before ended, until it saw each chunk's
    weights landed (median over the CTAs that waited on it), and until its last multiply; None for other builds."""
    if not hasattr(lib, "probe_timeline"):
        return None
    marks = torch.zeros(TIMELINE_CTAS, TIMELINE_SLOTS, dtype=torch.int64)
    rc = lib.probe_timeline(ctypes.c_void_p(marks.data_ptr()), TIMELINE_CTAS)
    assert rc == 0, f"probe_timeline failed: CUDA error {rc}"
    marks = marks[marks[:, 0] != 0]
    since = (marks - marks[:, :1]).double() / 1e3

    def median(slot: int) -> float | None:
        seen = since[marks[:, slot] != 0, slot]
        return float(seen.median()) if len(seen) else None

    arrivals = [a for a in (median(slot) for slot in CHUNK_SLOTS) if a is not None]
    end, waited = median(END_SLOT), median(WAITED_SLOT)
    if end is None or waited is None:
        return "no marks"
    return (f"waited until {waited:.1f}, chunks landed at {' '.join(f'{a:.1f}' for a in arrivals)} k cycles, last "
            f"multiply done at {end:.1f}")


def tokens(m: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random int8 codes [m, k] and their XBlocks (f32 scale, two int16 half sums) [m, k / 32]."""
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, device="cuda")
    xb = torch.randint(-(2**31), 2**31 - 1, (m, k // 32, 2), dtype=torch.int32, device="cuda")
    xb[:, :, 0] = (torch.rand(m, k // 32, device="cuda") * 0.01 + 0.01).view(torch.int32)
    return xq, xb


def cell(libs: list[ctypes.CDLL], name: str, n: int, k: int, m: int,
         warps: int) -> tuple[list[float], bool, list[str | None]]:
    """us per launch of each probe build with ``warps`` warps on the same weights and codes; whether the builds that
    leave nothing out (chunk sizes, copies and warp groups may differ) give the first one's bits: each warp takes the
    same units in the same order in all of them; and each timeline build's summary of its last timed launch."""
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

    times, timelines = [], []
    for lib in libs:
        timeline(lib)  # clears the marks of earlier cells' launches (the bits checks below launch too)
        times.append(timed(functools.partial(launch, lib), copies))
        timelines.append(timeline(lib))
    outputs = []
    for lib in (lib for lib in libs if lib.probe_part() == 0):
        y.view(torch.int16).fill_(-1)  # a NaN pattern, so rows a build leaves unwritten (almost surely) differ
        launch(lib, copies[0])
        outputs.append(y.view(torch.int16).clone())
    return times, all(torch.equal(out, outputs[0]) for out in outputs), timelines


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
                    us, same, timelines = cell(libs, name, n, k, m, warps)
                    bits = "same" if same else "DIFFER"
                    print(f"| {name} | {n}x{k} | {m} | {warps} | " + " | ".join(f"{u:.2f}" for u in us) +
                          f" | {bits} |", flush=True)
                    for lib_name, summary in zip(names, timelines, strict=True):
                        if summary is not None:
                            print(f"    timeline {lib_name}: {summary}", flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
