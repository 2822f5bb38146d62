"""Where a CUDA kernel's warps wait, per SASS instruction, from Nsight Compute's source page: how RESULTS.md's session
26 found the narrow GEMM's per-step division and jump table (a static count, sass_loop.py, cannot say what stalls).

On the GPU machine, one launch of the kernel (a driver script that calls it after a warm-up):

    ncu --clock-control none -k regex:narrow --launch-skip 1 -c 1 --section WarpStateStats --section SourceCounters \
        --import-source no --page source --print-source sass --csv python3 driver.py > src.csv
    python -m tests.tools.ncu_hotspots src.csv --top 25 --window 0x540-0xf00   # from the repository root

Prints the instructions with the most stall samples (offset from the function's first instruction, share of all
samples, executions, the reason with most samples, the SASS), a sample share per opcode, and with ``--window`` every
instruction of an offset range (a loop's body, say) with its samples.
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
from dataclasses import dataclass

from tests.tools.sass_loop import opcode

_SAMPLES = "Warp Stall Sampling (All Samples)"
_EXECUTED = "Instructions Executed"


@dataclass(frozen=True)
class Instruction:
    """One SASS instruction of the source page: its offset in the function, text, stall samples by reason."""

    offset: int
    sass: str
    samples: float
    executed: int
    reasons: dict[str, float]

    @property
    def opcode(self) -> str:
        return opcode(self.sass)

    def top_reason(self) -> str:
        return max(self.reasons, key=lambda r: self.reasons[r]) if any(self.reasons.values()) else "-"


def _number(text: str) -> float:
    return float(text.replace(",", "")) if text.strip() else 0.0


def parse(text: str) -> list[Instruction]:
    """The first kernel's instructions from ``ncu --page source --print-source sass --csv`` output (ncu's own
    ==PROF== lines and any other kernels are skipped)."""
    rows = list(csv.reader(io.StringIO("\n".join(line for line in text.splitlines() if line.startswith('"')))))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if start is None:
        raise ValueError("no source-page table (a header row starting with \"Address\") in the input")
    header = rows[start]
    at = {name: header.index(name) for name in ("Address", "Source", _SAMPLES, _EXECUTED)}
    reasons = [(i, name) for i, name in enumerate(header) if name.startswith("stall_")]
    out: list[Instruction] = []
    base = None
    for row in rows[start + 1 :]:
        if len(row) < len(header) or row[0] in ("Kernel Name", "Address"):
            break
        address = int(row[at["Address"]], 16)
        base = address if base is None else base
        out.append(Instruction(
            offset=address - base,
            sass=row[at["Source"]].strip(),
            samples=_number(row[at[_SAMPLES]]),
            executed=int(_number(row[at[_EXECUTED]])),
            reasons={name[len("stall_"):]: _number(row[i]) for i, name in reasons},
        ))
    return out


def hottest(code: list[Instruction], n: int) -> list[Instruction]:
    return sorted(code, key=lambda i: -i.samples)[:n]


def by_opcode(code: list[Instruction]) -> collections.Counter[str]:
    """Stall samples summed per opcode (BRA, SYNCS, HGMMA, IMAD ...)."""
    counts: collections.Counter[str] = collections.Counter()
    for ins in code:
        counts[ins.opcode] += ins.samples
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv", help="ncu --page source --print-source sass --csv output")
    ap.add_argument("--top", type=int, default=25, help="hottest instructions to list")
    ap.add_argument("--window", help="an offset range to list whole, e.g. 0x540-0xf00")
    args = ap.parse_args()
    with open(args.csv, encoding="utf-8") as f:
        code = parse(f.read())
    total = sum(i.samples for i in code) or 1.0
    print(f"{len(code)} instructions, {total:.0f} stall samples")
    for ins in hottest(code, args.top):
        share = 100 * ins.samples / total
        print(f"{ins.offset:#07x} {share:5.1f} % {ins.executed:>9} {ins.top_reason():<18} {ins.sass}")
    print("by opcode: " + ", ".join(f"{op} {100 * s / total:.1f} %" for op, s in by_opcode(code).most_common(12)))
    if args.window:
        lo, hi = (int(v, 16) for v in args.window.split("-"))
        for ins in code:
            if lo <= ins.offset <= hi:
                print(f"{ins.offset:#07x} {ins.samples:6.0f} {ins.executed:>9} {ins.sass}")


if __name__ == "__main__":
    main()
