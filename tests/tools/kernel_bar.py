"""Issue 6's kernel bar from one run of benches/bench_quant_cuda.py --json, as the table benches/RESULTS.md keeps:
one row per type, one column per token count, each cell the four Llama-3-8B shapes' best kernel as a percentage of
the copy ceiling, bold at or above the bar, starred where the best kernel is not the dp4a GEMV.

    python tests/tools/kernel_bar.py bar.json                       # the H200's 4.26 TB/s ceiling (the bench's)
    python tests/tools/kernel_bar.py bar.json --ceiling-gbs 2960    # an H100: its own copy ceiling

Why a ceiling option: the bench's fraction is of the H200's copy rate, so a run on an H100 must be rescaled to its
own (measured in the same session, e.g. 2.96 TB/s) before the bar means the same thing.

    python tests/tools/kernel_bar.py bar.json --ceiling-gbs 2960 --step   # per type and token count, the 4 shapes

--step adds one figure per type and token count: the four shapes' bytes over their best kernels' summed time, what
a Llama-3-8B decode step's linears see (the wide gate/up weight weighs most).

    python tests/tools/kernel_bar.py bar.json --ceiling-gbs 2960 --floor floor.json

--floor reads benches/probe_stream_floor.py --gguf's --json (the same machine): each shape's fastest stream with no
math, as a share of the ceiling (what any kernel of that weight reaches back to back), and each cell's best kernel
as a share of that floor. It tells the cells a GEMV cannot lift to the bar from those it has not yet.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.tools.compare_kernels import BAR_SHAPE_ORDER, BAR_SHAPES, BAR_TOKENS, NOT_GGUF

TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q2k", "q3k", "q4k", "q5k", "q6k"]
BENCH_CEILING_GBS = 4260.0

Best = dict[tuple[str, int, int, int], tuple[float, str]]  # (type, m, n, k) -> (fraction, kernel)


def table_rows(rows: list[dict[str, object]]) -> Iterator[tuple[tuple[str, int, int, int], str, dict[str, object]]]:
    """The GGUF kernel rows on the table's shapes at 1-8 tokens: ((type, tokens, n, k), kernel, row)."""
    for r in rows:
        kind, n, k, m = str(r["kind"]), int(r["n"]), int(r["k"]), int(r["m"])  # type: ignore[call-overload]
        if kind not in NOT_GGUF and (n, k) in BAR_SHAPES and m in BAR_TOKENS:
            yield (str(r["type"]), m, n, k), kind, r


def best_fractions(rows: list[dict[str, object]], ceiling_gbs: float) -> Best:
    """Per (type, tokens, n, k) of the table's shapes at 1-8 tokens: the best kernel's GB/s over ``ceiling_gbs``,
    and the kernel."""
    best: Best = {}
    for key, kind, r in table_rows(rows):
        fraction = float(r["gb_s"]) / ceiling_gbs  # type: ignore[arg-type]
        if key not in best or fraction > best[key][0]:
            best[key] = (fraction, kind)
    return best


def step_fractions(rows: list[dict[str, object]], ceiling_gbs: float) -> dict[tuple[str, int], float]:
    """Per (type, tokens) timed on all four of the table's shapes: their bytes over the summed time of each shape's
    fastest kernel, as a fraction of ``ceiling_gbs``."""
    fastest: dict[tuple[str, int, int, int], tuple[float, float]] = {}  # (type, m, n, k) -> (us, bytes)
    for key, _, r in table_rows(rows):
        us = float(r["us"])  # type: ignore[arg-type]
        if key not in fastest or us < fastest[key][0]:
            fastest[key] = (us, float(r["gb_s"]) * us * 1e3)  # type: ignore[arg-type]
    out: dict[tuple[str, int], float] = {}
    for qtype, m in {(key[0], key[1]) for key in fastest}:
        cells = [fastest.get((qtype, m, n, k)) for n, k in BAR_SHAPE_ORDER]
        if all(c is not None for c in cells):
            us = sum(c[0] for c in cells if c is not None)
            nbytes = sum(c[1] for c in cells if c is not None)
            out[(qtype, m)] = nbytes / (us * 1e3) / ceiling_gbs
    return out


def step_table(step: dict[tuple[str, int], float]) -> list[str]:
    """The --step table's lines: a type's row, its tokens' fractions in percent ("-" where a shape is missing)."""
    lines = ["| type | " + " | ".join(f"M = {m}" for m in sorted(BAR_TOKENS)) + " |",
             "|---|" + "---|" * len(BAR_TOKENS)]
    for qtype in [t for t in TYPES if any(key[0] == t for key in step)]:
        cells = [f"{100 * step[(qtype, m)]:.1f}" if (qtype, m) in step else "-" for m in sorted(BAR_TOKENS)]
        lines.append(f"| {qtype} | " + " | ".join(cells) + " |")
    return lines


def floor_fractions(floor: dict[str, Any], ceiling_gbs: float) -> dict[tuple[str, int, int], float]:
    """Per (type, n, k) in a probe_stream_floor.py --gguf --json: the fastest stream's bytes over its time (any
    variant, PDL or not), a fraction of ``ceiling_gbs``."""
    out: dict[tuple[str, int, int], float] = {}
    for qtype, shapes in floor["types"].items():
        for shape, row in shapes.items():
            n, k = (int(v) for v in shape.split("x"))
            us = min(float(v) for key, v in row.items() if key != "bytes")
            out[(qtype, n, k)] = float(row["bytes"]) / (us * 1e3) / ceiling_gbs
    return out


def floor_table(best: Best, floors: dict[tuple[str, int, int], float], bar: float) -> tuple[list[str], int]:
    """The floor's lines: per type its four shapes' stream floors (% of the ceiling), then per token count the best
    kernels' fractions over those floors (%); and how many timed cells have a floor below ``bar``."""
    lines = ["| type | stream floor | " + " | ".join(f"M = {m}, of the floor" for m in sorted(BAR_TOKENS)) + " |",
             "|---|---|" + "---|" * len(BAR_TOKENS)]
    below = 0
    for qtype in [t for t in TYPES if any(key[0] == t for key in best)]:
        cells = [" / ".join(f"{100 * floors[(qtype, n, k)]:.1f}" if (qtype, n, k) in floors else "-"
                            for n, k in BAR_SHAPE_ORDER)]
        for m in sorted(BAR_TOKENS):
            parts = []
            for n, k in BAR_SHAPE_ORDER:
                cell, floor = best.get((qtype, m, n, k)), floors.get((qtype, n, k))
                if cell is None or floor is None:
                    parts.append("-")
                    continue
                below += floor < bar
                parts.append(f"{100 * cell[0] / floor:.0f}")
            cells.append(" / ".join(parts))
        lines.append(f"| {qtype} | " + " | ".join(cells) + " |")
    return lines, below


def table(best: Best, bar: float) -> tuple[list[str], int, int]:
    """The markdown table's lines, the cells at or above ``bar`` and the cells timed."""
    lines = ["| type | " + " | ".join(f"M = {m}" for m in sorted(BAR_TOKENS)) + " |",
             "|---|" + "---|" * len(BAR_TOKENS)]
    met = timed = 0
    for qtype in [t for t in TYPES if any(key[0] == t for key in best)]:
        cells = []
        for m in sorted(BAR_TOKENS):
            parts = []
            for n, k in BAR_SHAPE_ORDER:
                if (qtype, m, n, k) not in best:
                    parts.append("-")
                    continue
                fraction, kind = best[(qtype, m, n, k)]
                timed += 1
                met += fraction >= bar
                text = f"{100 * fraction:.1f}" + ("" if kind == "dp4a" else "*")
                parts.append(f"**{text}**" if fraction >= bar else text)
            cells.append(" / ".join(parts))
        lines.append(f"| {qtype} | " + " | ".join(cells) + " |")
    return lines, met, timed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="a bench_quant_cuda.py --json file")
    ap.add_argument("--ceiling-gbs", type=float, default=BENCH_CEILING_GBS, help="the machine's copy rate, GB/s")
    ap.add_argument("--bar", type=float, default=0.75, help="issue 6's bar, a fraction of the copy ceiling")
    ap.add_argument("--step", action="store_true", help="also the four shapes together per type and token count")
    ap.add_argument("--floor", type=Path, help="a probe_stream_floor.py --gguf --json file from the same machine")
    args = ap.parse_args()
    rows = json.loads(args.run.read_text())
    best = best_fractions(rows, args.ceiling_gbs)
    lines, met, timed = table(best, args.bar)
    print("\n".join(lines))
    print(f"{met} of {timed} cells at >= {100 * args.bar:.0f} % of {args.ceiling_gbs:.0f} GB/s")
    if args.step:
        print("\nThe four shapes together (bytes over the summed time of each shape's fastest kernel), %:")
        print("\n".join(step_table(step_fractions(rows, args.ceiling_gbs))))
    if args.floor:
        floor_lines, below = floor_table(best, floor_fractions(json.loads(args.floor.read_text()), args.ceiling_gbs),
                                         args.bar)
        print("\nThe stream floor (% of the ceiling) and each cell's best kernel over it (%):")
        print("\n".join(floor_lines))
        print(f"{below} of {timed} cells have a floor below {100 * args.bar:.0f} %")


if __name__ == "__main__":
    main()
