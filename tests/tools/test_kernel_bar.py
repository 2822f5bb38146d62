"""kernel_bar.py on bench_quant_cuda-shaped --json rows (the real runs need the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tools.kernel_bar import (
    best_fractions,
    floor_fractions,
    floor_table,
    step_fractions,
    step_table,
    table,
)


def _row(kind: str, qtype: str, n: int, k: int, m: int, gb_s: float) -> dict[str, object]:
    return {"kind": kind, "type": qtype, "n": n, "k": k, "m": m, "us": 1.0, "gb_s": gb_s, "fraction": gb_s / 4260.0}


ROWS = [
    _row("dp4a", "q4k", 4096, 4096, 1, 2400.0),
    _row("mmq/autoxauto/auto", "q4k", 4096, 4096, 1, 2000.0),  # slower than dp4a: not the cell's kernel
    _row("dp4a", "q4k", 28672, 4096, 8, 1500.0),
    _row("mmq/autoxauto/auto", "q4k", 28672, 4096, 8, 2300.0),  # the tensor-core product wins: starred
    _row("dp4a", "q4k", 128256, 4096, 1, 4000.0),  # the LM head: outside the table
    _row("bf16", "bf16", 4096, 4096, 1, 4100.0),  # the dense baseline: never a cell
    _row("dp4a", "q4k", 4096, 4096, 16, 4000.0),  # 16 tokens: outside the table
    _row("dp4a", "q2k", 4096, 14336, 2, 1000.0),
]


def test_best_kernel_per_cell_over_the_given_ceiling() -> None:
    best = best_fractions(ROWS, 2960.0)
    assert best[("q4k", 1, 4096, 4096)] == (2400.0 / 2960.0, "dp4a")
    assert best[("q4k", 8, 28672, 4096)] == (2300.0 / 2960.0, "mmq/autoxauto/auto")
    assert len(best) == 3  # the LM head, the dense baseline and 16 tokens are left out


def test_table_marks_the_bar_and_the_tensor_core_product() -> None:
    lines, met, timed = table(best_fractions(ROWS, 2960.0), 0.75)
    assert lines[0] == "| type | M = 1 | M = 2 | M = 4 | M = 8 |"
    q2k, q4k = lines[2], lines[3]  # the table's type order: q2k before q4k
    assert q2k == "| q2k | - / - / - / - | - / - / 33.8 / - | - / - / - / - | - / - / - / - |"
    assert q4k == "| q4k | **81.1** / - / - / - | - / - / - / - | - / - / - / - | - / - / - / **77.7*** |"
    assert (met, timed) == (2, 3)
    # The same run read against the H200's ceiling: nothing reaches 75 %.
    assert table(best_fractions(ROWS, 4260.0), 0.75)[1] == 0


def test_the_command_line_prints_the_table_and_the_count(tmp_path: Path) -> None:
    run = tmp_path / "bar.json"
    run.write_text(json.dumps(ROWS))
    tool = Path(__file__).with_name("kernel_bar.py")
    out = subprocess.run([sys.executable, str(tool), str(run), "--ceiling-gbs", "2960"],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[-1] == "2 of 3 cells at >= 75 % of 2960 GB/s" and len(out) == 5


def test_step_takes_the_four_shapes_fastest_kernels_bytes_over_their_time() -> None:
    shapes = [(4096, 4096, 2.0, 1000.0), (6144, 4096, 3.0, 1500.0), (4096, 14336, 7.0, 2000.0),
              (28672, 4096, 14.0, 2500.0)]
    rows: list[dict[str, object]] = []
    for n, k, us, gb_s in shapes:
        rows.append({"kind": "dp4a", "type": "q8_0", "n": n, "k": k, "m": 8, "us": us, "gb_s": gb_s,
                     "fraction": 0.0})
        rows.append({"kind": "mmq/autoxauto/auto", "type": "q8_0", "n": n, "k": k, "m": 8, "us": 2 * us,
                     "gb_s": gb_s / 2, "fraction": 0.0})  # slower: not the shape's kernel
    rows.append({"kind": "dp4a", "type": "q4k", "n": 4096, "k": 4096, "m": 1, "us": 1.0, "gb_s": 2000.0,
                 "fraction": 0.0})  # one shape only: no step figure
    step = step_fractions(rows, 2960.0)
    want = sum(us * gb for _, _, us, gb in shapes) / sum(us for _, _, us, _ in shapes) / 2960.0
    assert set(step) == {("q8_0", 8)} and abs(step[("q8_0", 8)] - want) < 1e-12
    assert step_table(step)[2] == f"| q8_0 | - | - | - | {100 * want:.1f} |"


def test_floor_reads_the_fastest_stream_and_sets_each_cell_against_it(tmp_path: Path) -> None:
    floor = {"sms": 132, "ceiling": 2.96e12, "types": {
        "q4k": {"4096x4096": {"bytes": 9437184, "ld g528 t512 pdl0": 4.0, "ring g132 16Kx12 pdl1": 3.6},
                "28672x4096": {"bytes": 66060288, "ld g528 t512 pdl0": 24.0}},
        "q2k": {"4096x14336": {"bytes": 19267584, "ld g528 t512 pdl1": 9.0}}}}
    floors = floor_fractions(floor, 2960.0)
    q4k_floor = 9437184 / 3.6e3 / 2960.0  # the faster variant, PDL or not
    q2k_floor = 19267584 / 9.0e3 / 2960.0
    assert floors == {("q4k", 4096, 4096): q4k_floor, ("q4k", 28672, 4096): 66060288 / 24.0e3 / 2960.0,
                      ("q2k", 4096, 14336): q2k_floor}
    lines, below = floor_table(best_fractions(ROWS, 2960.0), floors, 0.75)
    q2k, q4k = lines[2].split(" | "), lines[3].split(" | ")
    # The floor column (shapes 4096x4096 / 6144x4096 / 4096x14336 / 28672x4096), then the cells over their floors.
    assert q2k[1] == f"- / - / {100 * q2k_floor:.1f} / -"
    assert q2k[3] == f"- / - / {100 * (1000.0 / 2960.0) / q2k_floor:.0f} / -"  # ROWS' q2k cell is at two tokens
    assert q4k[2] == f"{100 * (2400.0 / 2960.0) / q4k_floor:.0f} / - / - / -"
    assert q4k[5].startswith(f"- / - / - / {100 * (2300.0 / 2960.0) / (66060288 / 24.0e3 / 2960.0):.0f}")
    # Timed cells on shapes with a floor: q4k 4096x4096 (floor 88.6 %), q4k 28672x4096 (93.0 %), q2k (72.3 %).
    assert below == 1
    run, probe = tmp_path / "bar.json", tmp_path / "floor.json"
    run.write_text(json.dumps(ROWS))
    probe.write_text(json.dumps(floor))
    tool = Path(__file__).with_name("kernel_bar.py")
    out = subprocess.run([sys.executable, str(tool), str(run), "--ceiling-gbs", "2960", "--floor", str(probe)],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[-1] == f"{below} of 3 cells have a floor below 75 %"
