"""compare_kernels.py on bench_quant_cuda-shaped --json rows (the real runs need the GPU machine)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.tools.compare_kernels import bar_cells, best_per_cell, compare, load, of_kind, summed


def _row(kind: str, qtype: str, n: int, k: int, m: int, us: float, fraction: float) -> dict[str, object]:
    return {"kind": kind, "type": qtype, "n": n, "k": k, "m": m, "us": us, "gb_s": 4260.0 * fraction,
            "fraction": fraction}


A_ROWS = [
    _row("bf16", "bf16", 4096, 4096, 1, 9.0, 0.90),  # the dense baseline: never a GGUF cell
    _row("dp4a", "q8_0", 4096, 4096, 1, 6.0, 0.70),
    _row("mmq/autoxauto/auto", "q8_0", 4096, 4096, 1, 9.0, 0.47),
    _row("dp4a", "q8_0", 28672, 4096, 4, 46.0, 0.68),
    _row("mmq/autoxauto/auto", "q8_0", 28672, 4096, 4, 43.0, 0.73),
    _row("dp4a", "q8_0", 128256, 4096, 1, 128.0, 0.95),  # the LM head: outside the bar
    _row("dp4a", "q5_0", 28672, 4096, 16, 60.0, 0.80),  # 16 tokens: outside the bar
    _row("dequant", "q8_0", 28672, 4096, 0, 30.0, 0.50),
]
B_ROWS = [
    _row("dp4a", "q8_0", 4096, 4096, 1, 5.4, 0.78),
    _row("mmq/autoxauto/auto", "q8_0", 4096, 4096, 1, 9.9, 0.43),
    _row("dp4a", "q8_0", 28672, 4096, 4, 38.7, 0.76),
    _row("mmq/autoxauto/auto", "q8_0", 28672, 4096, 4, 43.0, 0.73),
    _row("dp4a", "q5_0", 4096, 4096, 2, 6.0, 0.45),  # only B timed it
]


def _write(tmp_path: Path, name: str, rows: list[dict[str, object]]) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(rows))
    return path


def test_cells_best_kernel_and_changes(tmp_path: Path) -> None:
    a, b = load(_write(tmp_path, "a.json", A_ROWS)), load(_write(tmp_path, "b.json", B_ROWS))
    assert ("bf16", "bf16", 4096, 4096, 1) not in a and ("dequant", "q8_0", 28672, 4096, 0) not in a
    best = best_per_cell(a)
    assert best[("best", "q8_0", 4096, 4096, 1)] == (6.0, 0.70)
    assert best[("best", "q8_0", 28672, 4096, 4)] == (43.0, 0.73)
    changes = {c: (ua, ub, round(pct, 6)) for c, ua, ub, pct in compare(a, b)}
    assert changes[("dp4a", "q8_0", 4096, 4096, 1)] == (6.0, 5.4, -10.0)
    assert changes[("mmq/autoxauto/auto", "q8_0", 4096, 4096, 1)] == (9.0, 9.9, 10.0)
    assert ("dp4a", "q5_0", 4096, 4096, 2) not in changes and len(changes) == 4
    best_changes = {c: round(pct, 6) for c, _, _, pct in compare(best_per_cell(a), best_per_cell(b))}
    assert best_changes[("best", "q8_0", 28672, 4096, 4)] == round(100 * (38.7 / 43.0 - 1), 6)


def test_bar_cells_take_the_8b_shapes_at_1_to_8_tokens(tmp_path: Path) -> None:
    a, b = load(_write(tmp_path, "a.json", A_ROWS)), load(_write(tmp_path, "b.json", B_ROWS))
    assert bar_cells(a, 0.75) == []  # the LM head's and 16 tokens' cells are above the bar but outside it
    assert bar_cells(b, 0.75) == [("best", "q8_0", 4096, 4096, 1), ("best", "q8_0", 28672, 4096, 4)]
    assert bar_cells(a, 0.70) == [("best", "q8_0", 4096, 4096, 1), ("best", "q8_0", 28672, 4096, 4)]


def test_the_command_line_prints_each_cell_and_the_bar(tmp_path: Path) -> None:
    a, b = _write(tmp_path, "a.json", A_ROWS), _write(tmp_path, "b.json", B_ROWS)
    tool = Path(__file__).with_name("compare_kernels.py")
    out = subprocess.run([sys.executable, str(tool), str(a), str(b), "--types", "q8_0", "--best"],
                         check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[0].split()[:4] == ["best", "q8_0", "4096x4096", "M=1"] and out[0].endswith("-10.0 %")
    assert out[-2].startswith("A: 0 bar cells") and out[-1].startswith("B: 2 bar cells")


def test_sums_per_shape_take_only_the_tokens_both_runs_timed(tmp_path: Path) -> None:
    rows_a = [_row("mmq", "q4_0", 4096, 4096, m, us, 0.5) for m, us in ((2, 5.0), (4, 6.0), (8, 7.0))]
    rows_a.append(_row("mmq", "q4_0", 28672, 4096, 2, 30.0, 0.5))
    rows_b = [_row("mmq", "q4_0", 4096, 4096, m, us, 0.5) for m, us in ((2, 4.0), (4, 5.5), (16, 9.0))]
    rows_b.append(_row("mmq", "q4_0", 28672, 4096, 2, 33.0, 0.5))
    a, b = load(_write(tmp_path, "a.json", rows_a)), load(_write(tmp_path, "b.json", rows_b))
    got = {shape: (ua, ub, round(pct, 6)) for shape, ua, ub, pct in summed(a, b)}
    assert got == {("mmq", "q4_0", 4096, 4096): (11.0, 9.5, round(100 * (9.5 / 11.0 - 1), 6)),
                   ("mmq", "q4_0", 28672, 4096): (30.0, 33.0, round(100 * (33.0 / 30.0 - 1), 6))}


def test_kinds_pair_two_launch_choices_of_one_run(tmp_path: Path) -> None:
    rows = [_row("mmq/autoxauto/auto", "q8_0", 4096, 4096, 8, 10.0, 0.5),
            _row("mmq/autox16/auto", "q8_0", 4096, 4096, 8, 8.0, 0.6),
            _row("mmq/autox16/auto", "q8_0", 4096, 4096, 4, 7.0, 0.6),  # the rule's launch did not time it
            _row("dp4a", "q8_0", 4096, 4096, 8, 20.0, 0.3)]
    run = _write(tmp_path, "warps.json", rows)
    cells = load(run)
    assert of_kind(cells, "dp4a") == {("kinds", "q8_0", 4096, 4096, 8): (20.0, 0.3)}
    changes = compare(of_kind(cells, "mmq/autoxauto/auto"), of_kind(cells, "mmq/autox16/auto"))
    assert [(c, ua, ub, round(pct, 6)) for c, ua, ub, pct in changes] == [
        (("kinds", "q8_0", 4096, 4096, 8), 10.0, 8.0, -20.0)]
    tool = Path(__file__).with_name("compare_kernels.py")
    out = subprocess.run([sys.executable, str(tool), str(run), str(run), "--kinds", "mmq/autoxauto/auto",
                          "mmq/autox16/auto"], check=True, capture_output=True, text=True).stdout.splitlines()
    assert out[0].split()[:4] == ["kinds", "q8_0", "4096x4096", "M=8"] and out[0].endswith("-20.0 %")
