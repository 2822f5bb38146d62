"""ncu_hotspots.py's parsing, on an ncu-shaped source page (the real input needs Nsight Compute on a GPU)."""

from __future__ import annotations

import pytest

from tests.tools.ncu_hotspots import by_opcode, hottest, parse

HEADER = (
    '"Address","Source","Warp Stall Sampling (All Samples)","Warp Stall Sampling (Not-issued Samples)",'
    '"Instructions Executed","stall_long_sb","stall_short_sb"'
)
PAGE = f"""==PROF== Connected to process 1 (/usr/bin/python3)
==PROF== Disconnected from process 1
"Kernel Name","void k(int)",
{HEADER}
"0x7f0000001000","      IMAD.HI.U32 R3, R5, R3, R4","12","10","32,768","0","12"
"0x7f0000001010","      SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [R12+URZ], R11","3","3","32768","3","0"
"0x7f0000001020","@!P0  BRA 0x7f0000001010","1,543","1,500","32768","1,543","0"
"0x7f0000001030","      HGMMA.64x32x16.F32.BF16 R24, gdesc[UR4], R24","89","80","32768","0","0"
"Kernel Name","void other(int)",
{HEADER}
"0x7f0000009000","      EXIT","999","0","1","0","0"
"""


def test_the_first_kernels_instructions_with_offsets_samples_and_reasons() -> None:
    code = parse(PAGE)
    assert [i.offset for i in code] == [0x0, 0x10, 0x20, 0x30]  # the second kernel is not read
    assert code[0].executed == 32768 and code[2].samples == 1543.0  # thousands separators
    assert [i.opcode for i in code] == ["IMAD", "SYNCS", "BRA", "HGMMA"]  # predicates dropped
    assert code[2].top_reason() == "long_sb" and code[0].top_reason() == "short_sb"
    assert code[3].top_reason() == "-"  # no reason column has samples
    assert [i.offset for i in hottest(code, 2)] == [0x20, 0x30]
    assert by_opcode(code) == {"BRA": 1543.0, "HGMMA": 89.0, "IMAD": 12.0, "SYNCS": 3.0}


def test_input_without_a_source_table_is_refused() -> None:
    with pytest.raises(ValueError, match="no source-page table"):
        parse('==PROF== Disconnected\n"Kernel Name","void k(int)",\n')
