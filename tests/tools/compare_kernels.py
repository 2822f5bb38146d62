"""Two runs of benches/bench_quant_cuda.py --json side by side (A -> B), offline: how a GPU A/B call (a branch against
main rebuilt in the same call) is read, and where issue 6's kernel bar stands in each.

    python tests/tools/compare_kernels.py main.json branch.json              # every cell both runs timed
    python tests/tools/compare_kernels.py main.json branch.json --types q5_0 --best
    python tests/tools/compare_kernels.py hold0.json hold1.json --sums      # per shape, summed over the tokens
    python tests/tools/compare_kernels.py warps.json warps.json --kinds mmq/autoxauto/auto mmq/autox16/auto

Each line is one cell (kernel, type, shape, tokens): A's and B's microseconds and B's change. --best compares the
better kernel per cell instead (the decode path takes whichever its thresholds pick; the bar counts the better one).
--sums sums each (kernel, type, shape) over the tokens both runs timed, one line per shape: how a kernel's layout
choice (one per type and shape) is read from an A/B. --kinds KIND_A KIND_B compares two launch choices instead: A's
cells of one kernel kind against B's of another (both files may be the same run, e.g. gpu_check.sh's warps stage).
The last lines count each run's bar cells: >= --bar of the copy ceiling (bench_quant_cuda's fraction) at 1-8 tokens
on the four Llama-3-8B shapes, the better kernel per cell.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# bench_quant_cuda.SHAPES (not the LM head), in benches/RESULTS.md's column order
BAR_SHAPE_ORDER = [(4096, 4096), (6144, 4096), (4096, 14336), (28672, 4096)]
BAR_SHAPES = set(BAR_SHAPE_ORDER)
BAR_TOKENS = {1, 2, 4, 8}
NOT_GGUF = {"bf16", "dequant"}

Cell = tuple[str, str, int, int, int]  # kernel, type, n, k, m
Timing = tuple[float, float]  # us, fraction of the copy ceiling
Shape = tuple[str, str, int, int]  # kernel, type, n, k


def load(path: Path) -> dict[Cell, Timing]:
    """A --json file's GGUF kernel rows by cell (the dense baseline and the dequantize rows left out)."""
    rows = json.loads(Path(path).read_text())
    return {(r["kind"], r["type"], r["n"], r["k"], r["m"]): (r["us"], r["fraction"])
            for r in rows if r["kind"] not in NOT_GGUF}


def best_per_cell(cells: dict[Cell, Timing]) -> dict[Cell, Timing]:
    """The faster kernel of each (type, shape, tokens), keyed with the kernel "best"."""
    out: dict[Cell, Timing] = {}
    for (_, qtype, n, k, m), timing in cells.items():
        key = ("best", qtype, n, k, m)
        if key not in out or timing[0] < out[key][0]:
            out[key] = timing
    return out


def bar_cells(cells: dict[Cell, Timing], bar: float) -> list[Cell]:
    """The bar's cells (BAR_SHAPES at BAR_TOKENS, the better kernel) at or above ``bar``, in order."""
    best = best_per_cell(cells)
    return sorted(c for c, (_, fraction) in best.items()
                  if (c[2], c[3]) in BAR_SHAPES and c[4] in BAR_TOKENS and fraction >= bar)


def of_kind(cells: dict[Cell, Timing], kind: str) -> dict[Cell, Timing]:
    """The cells of one kernel ``kind``, keyed with the kernel "kinds", so that two launch choices pair up."""
    return {("kinds", *c[1:]): t for c, t in cells.items() if c[0] == kind}


def compare(a: dict[Cell, Timing], b: dict[Cell, Timing]) -> list[tuple[Cell, float, float, float]]:
    """Cells both runs timed: (cell, A's us, B's us, B's change in percent), in cell order."""
    return [(c, a[c][0], b[c][0], 100.0 * (b[c][0] / a[c][0] - 1.0)) for c in sorted(a.keys() & b.keys())]


def summed(a: dict[Cell, Timing], b: dict[Cell, Timing]) -> list[tuple[Shape, float, float, float]]:
    """Per (kernel, type, n, k): A's and B's microseconds summed over the tokens both runs timed, and B's change in
    percent, in order."""
    sums: dict[Shape, list[float]] = {}
    for (kind, qtype, n, k, _), us_a, us_b, _ in compare(a, b):
        total = sums.setdefault((kind, qtype, n, k), [0.0, 0.0])
        total[0] += us_a
        total[1] += us_b
    return [(shape, ua, ub, 100.0 * (ub / ua - 1.0)) for shape, (ua, ub) in sorted(sums.items())]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="the baseline run's --json")
    ap.add_argument("b", type=Path, help="the changed run's --json")
    ap.add_argument("--types", nargs="*", default=None, help="only these types (default: every type in both)")
    ap.add_argument("--best", action="store_true", help="the better kernel per cell instead of every kernel")
    ap.add_argument("--bar", type=float, default=0.75, help="issue 6's bar, a fraction of the copy ceiling")
    ap.add_argument("--sums", action="store_true", help="one line per kernel, type and shape, summed over tokens")
    ap.add_argument("--kinds", nargs=2, metavar=("KIND_A", "KIND_B"), default=None,
                    help="A's cells of KIND_A against B's of KIND_B (e.g. mmq/autoxauto/auto mmq/autox16/auto)")
    args = ap.parse_args()
    a, b = load(args.a), load(args.b)
    if args.kinds:
        a, b = of_kind(a, args.kinds[0]), of_kind(b, args.kinds[1])
    if args.types:
        a = {c: t for c, t in a.items() if c[1] in args.types}
        b = {c: t for c, t in b.items() if c[1] in args.types}
    shown_a, shown_b = (best_per_cell(a), best_per_cell(b)) if args.best else (a, b)
    if args.sums:
        for (kind, qtype, n, k), us_a, us_b, change in summed(shown_a, shown_b):
            print(f"{kind:20s} {qtype:5s} {n:>6d}x{k:<6d} all M  {us_a:8.2f} -> {us_b:8.2f} us  {change:+6.1f} %")
    else:
        for (kind, qtype, n, k, m), us_a, us_b, change in compare(shown_a, shown_b):
            print(f"{kind:20s} {qtype:5s} {n:>6d}x{k:<6d} M={m}  {us_a:8.2f} -> {us_b:8.2f} us  {change:+6.1f} %")
    for label, cells in (("A", a), ("B", b)):
        met = bar_cells(cells, args.bar)
        print(f"{label}: {len(met)} bar cells at >= {100 * args.bar:.0f} %: "
              + (", ".join(f"{q} {n}x{k} M={m}" for _, q, n, k, m in met) or "none"))


if __name__ == "__main__":
    main()
