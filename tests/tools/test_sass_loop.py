"""sass_loop.py's parsing, on a cuobjdump-shaped listing (the real tool needs nvcc and cuobjdump, absent in CI)."""

from __future__ import annotations

from tests.tools.sass_loop import functions, longest_loop, opcode_counts, span

LISTING = """
\t\tFunction : _Z6kernelPi
\t.headerflags\t@"EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                 /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                     /* 0x0000000000007919 */
        /*0020*/                   LDG.E R2, desc[UR4][R4.64] ;           /* 0x0000000404027981 */
        /*0030*/                   IDP.4A.S8.S8 R3, R2, R2, R3 ;          /* 0x0000000202037226 */
        /*0040*/              @!P0 LOP3.LUT R2, R2, 0xf, RZ, 0xc0, !PT ; /* 0x0000000f02028812 */
        /*0050*/               @P1 BRA 0x20 ;                             /* 0x0000000000001947 */
        /*0060*/                   BRA 0x0010 ;                           /* 0xfffffffc00007947 */
        /*0070*/                   EXIT ;                                 /* 0x000000000000794d */
\t\tFunction : _Z5otherv
        /*0000*/                   EXIT ;                                 /* 0x000000000000794d */
"""


def test_the_longest_backward_branch_bounds_the_loop() -> None:
    code = functions(LISTING)
    assert list(code) == ["_Z6kernelPi", "_Z5otherv"]
    body = longest_loop(code["_Z6kernelPi"])
    assert len(body) == 6 and body[0].startswith("S2R") and body[-1].startswith("BRA 0x0010")
    assert opcode_counts(body) == {"S2R": 1, "LDG": 1, "IDP": 1, "LOP3": 1, "BRA": 2}
    assert longest_loop(code["_Z5otherv"]) == []


def test_a_span_runs_from_the_first_start_to_the_next_end() -> None:
    code = functions(LISTING)["_Z6kernelPi"]
    assert [t.split()[0] for t in span(code, r"S2R", r"BRA")] == ["LDG.E", "IDP.4A.S8.S8", "@!P0"]
    assert span(code, r"LDG", r"LDC") == []  # no END after START
    assert span(code, r"HMMA", r"BRA") == []
