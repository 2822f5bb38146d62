"""The dp4a GGUF GEMV's launch choices (weight rows per CTA, at one token and at several) give the default's bits,
and the default rule picks what the H200 sweep measured fastest.

Every choice only changes which CTA owns a row: each output row is still summed by the same threads over the same
blocks in the same order and reduced the same way, so the result must be bit-identical to the default launch
(rows=0), which itself is held to the float64 oracle bound of test_cuda_gguf (the `gguf` package's dequantizer).
Shapes: odd N (a partial last CTA for every R), K = 14336 (several slots per thread) and K = 768 (fewer slots
than threads: idle threads).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_cuda_gguf import assert_dp4a_within, device_blocks, oracle, random_blocks

from candle_vllm.pyengine.ops import cuda_gguf, native
from candle_vllm.pyengine.ops.cuda import sm_count
from candle_vllm.pyengine.ops.q8_activation import BLOCK, Q8Activation

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
DP4A_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
ROWS = (0, 2, 4, 8)  # one or two tokens; from three up, 8 is refused


def rows_choices(m: int) -> tuple[int, ...]:
    return ROWS if m <= 2 else ROWS[:-1]


# The H200 sweep (132 SMs, bench_quant_cuda.py --sweep-rows) at one token on the Llama-3-8B output sizes
# N = 6144, 4096, 28672 (K 4096) and 4096 (K 14336): the faster of R = 4 and R = 8 where they differ by more than
# 2 % (q4k 7.51 / 7.51, 5.34 / 4.96, 20.61 / 23.40, 12.59 / 12.71 us; q5k 8.65 / 9.03, 5.94 / 5.79, 27.04 / 30.05,
# 15.38 / 15.23 us); None where they were even.
H200_SMS = 132
H200_SHAPES_N = (6144, 4096, 28672, 4096)
H200_SHAPES_K = (4096, 4096, 4096, 14336)
H200_FASTER = {QT.Q4_K: (None, 8, 4, None), QT.Q5_K: (4, 8, 4, None)}
# Measured per type at one token: R = 4 best over the four shapes for the 32-element types (session 33), Q3_K and
# Q6_K (best or within 1 %). Q2_K: R = 8 on the small weights, 4 on those of more than 2^25 elements (the long grid
# and the long rows stream better with more CTAs per SM).
FIXED_ROWS = {QT.Q4_0: 4, QT.Q4_1: 4, QT.Q5_0: 4, QT.Q5_1: 4, QT.Q8_0: 4, QT.Q6_K: 4, QT.Q3_K: 4}
# The K-quants at two tokens, per shape (session 38's sweep, H100, 132 SMs: --sweep-rows --m 2 --codes): R = 4 ahead
# of 8 on the weights of more than one wave of 8-row CTAs (6144x4096: q2k 7.59 / 9.06 us, q3k 8.44 / 8.82, q4k 8.89 /
# 8.93, q5k 10.14 / 10.38, q6k 11.20 / 11.31; 28672x4096: q2k 25.16 / 26.70, q3k 28.08 / 31.47, q4k 28.53 / 29.97,
# q6k 35.78 / 39.71), 8 on the others (4096x4096 q4k 5.84 / 7.12; 4096x14336 q4k 15.19 / 16.95); None where within
# 2 % (q5k 28672x4096 37.66 / 37.12). Q5_0, Q5_1 and Q8_0 (sessions 48 and 49's H200 sweeps): 4 on 6144x4096, 8 on
# 4096x4096; Q8_0 4 on 28672x4096 (30.26 against 31.38-33.07 at 8), Q5_0 8 on 4096x14336 (12.43 against 14.05 at 4),
# Q5_1 2 on 4096x14336 (13.02 / 13.34 against 14.17 at 8 / 14.40 at 4). Q4_0 and Q4_1 with their 8-row launch row by
# row (session 49, H100): 4 on 6144x4096 (8.06 / 8.58, 7.69 / 7.96), 8 on 4096x4096 (5.53 / 6.01, 5.26 / 6.19), Q4_1 8
# on 4096x14336 (14.27 / 14.86); q4_1's 28672x4096 within 2 %, and q4_0's 28672x4096 and 4096x14336 miss (3.6 and
# 2.6 %), so None.
K_QUANTS = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)
TWO_TOKEN_FASTER: dict[QT, tuple[int | None, ...]] = {
    **{t: (4, 8, 4, 8) for t in (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q6_K)}, QT.Q5_K: (4, 8, None, 8),
    QT.Q8_0: (4, 8, 4, 8), QT.Q5_0: (4, 8, None, 8), QT.Q5_1: (4, 8, None, 2),
    QT.Q4_0: (4, 8, None, None), QT.Q4_1: (4, 8, None, 8)}


def expected_rows(qtype: QT, n: int, k: int) -> int | None:
    """The default one-token rows the rule should give, None where it depends on the device (Q4_K/Q5_K)."""
    if qtype == QT.Q2_K:
        return 4 if n * k > 1 << 25 else 8
    return FIXED_ROWS.get(qtype)


@pytest.mark.parametrize("m", [1, 2, 3, 8])
@pytest.mark.parametrize("k", [14336, 768])
@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_every_launch_choice_equals_the_default(qtype: QT, k: int, m: int) -> None:
    n = 333
    raw = random_blocks(qtype, n, k, seed=7 * int(qtype) + k)
    data = device_blocks(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k + int(qtype) + m)).to(torch.bfloat16)
    want = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, kernel="dp4a")
    assert_dp4a_within(want, x, oracle(raw, qtype, n, k).double())
    for rows in rows_choices(m):
        got = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, kernel="dp4a", rows=rows)
        assert torch.equal(got, want), f"{qtype.name} K={k} M={m} rows={rows}: bits differ"


@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_pipelined_one_token_rows_equal_the_plain_loop(qtype: QT) -> None:
    """One Q4_K token over rows longer than one pass of the CTA (K = 14336) runs the pipelined loop, which fetches
    the next pass before using this one, and Q2_K the row-by-row loop at one and two tokens; two tokens run the plain
    loop, but Q4_0/Q4_1's 8-row launch (N = 333 takes 8 rows) the row-by-row one. Each token's sums keep their
    order either way, so token 0 of a two-token launch has the one-token launch's bits."""
    n, k = 333, 14336
    raw = random_blocks(qtype, n, k, seed=11 * int(qtype))
    data = device_blocks(raw, qtype)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(int(qtype))).to(torch.bfloat16).to(DEV)
    one = cuda_gguf.gemv(x[:1], data, qtype, n, k, kernel="dp4a")
    assert_dp4a_within(one, x[:1].cpu(), oracle(raw, qtype, n, k).double())
    two = cuda_gguf.gemv(x, data, qtype, n, k, kernel="dp4a")
    assert torch.equal(one[0], two[0]), f"{qtype.name}: bits differ"


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_choices_on_quantized_activations(dtype: torch.dtype, m: int) -> None:
    """The path that takes codes a producer kernel wrote (no quantizer launch) honours the choices too."""
    qtype, n, k = QT.Q4_K, 517, 4096
    raw = random_blocks(qtype, n, k, seed=3)
    data = device_blocks(raw, qtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    mod = native.loaded()
    xq = torch.empty(m, k, dtype=torch.int8, device=DEV)
    xb = torch.empty(m, k // BLOCK * mod.cuda_gguf_xblock_bytes, dtype=torch.uint8, device=DEV)
    want = torch.empty(m, n, dtype=dtype, device=DEV)
    mod.cuda_gguf_gemv_q8(want.data_ptr(), x.data_ptr(), xq.data_ptr(), xb.data_ptr(), data.data_ptr(), m, n, k,
                          int(qtype), native.dtype_code(x), native.stream(DEV))
    assert_dp4a_within(want, x.cpu(), oracle(raw, qtype, n, k).double())
    q8 = Q8Activation(x, xq, xb, 32)
    for rows in rows_choices(m):
        got = cuda_gguf.gemv(q8, data, qtype, n, k, rows=rows)
        assert torch.equal(got, want), f"rows={rows}: bits differ"


def test_unsupported_choices_are_refused() -> None:
    qtype, n, k = QT.Q8_0, 64, 256
    data = device_blocks(random_blocks(qtype, n, k, seed=1), qtype)
    x = torch.randn(3, k, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="8 only for one or two tokens"):
        cuda_gguf.gemv(x, data, qtype, n, k, rows=8)
    for rows in (1, 3, 16):
        with pytest.raises(ValueError, match="rows must be"):
            cuda_gguf.gemv(x[:1], data, qtype, n, k, rows=rows)
    with pytest.raises(ValueError, match="mma kernel does not take it"):
        cuda_gguf.gemv(x[:1], data, qtype, n, k, kernel="mma", rows=2)


def test_gemv_rows_reports_the_launch() -> None:
    """An explicit choice is what launches; by default two tokens take the wave rule (8 rows where one wave of 8-row
    CTAs covers N, as it does a 64-row weight on any GPU, 4 where none does, as for the 128256-row LM head; Q5_1's rows
    longer than 8192 take 2) and three or more 4; one token takes the measured per-type rows, and R = 4 or 8 for
    Q4_K/Q5_K."""
    for qtype in DP4A_TYPES:
        assert [cuda_gguf.gemv_rows(qtype, m, 4096, 4096, rows=r) for m, r in ((1, 8), (2, 8), (2, 4), (8, 2))] == [
            8, 8, 4, 2]
        assert [cuda_gguf.gemv_rows(qtype, m, 4096, 4096) for m in (3, 8)] == [4, 4]
        assert [cuda_gguf.gemv_rows(qtype, 2, n, 4096) for n in (64, 128256)] == [8, 4], qtype.name
        assert cuda_gguf.gemv_rows(qtype, 2, 64, 14336) == (2 if qtype == QT.Q5_1 else 8), qtype.name
        for n, k in ((1, 256), (333, 768), *zip(H200_SHAPES_N, H200_SHAPES_K, strict=True), (128256, 4096)):
            want = expected_rows(qtype, n, k)
            got = cuda_gguf.gemv_rows(qtype, 1, n, k)
            assert got == want if want is not None else got in (4, 8), f"{qtype.name} {n}x{k}: {got}"


def test_wave_rule_picks_the_sweeps_faster_launch() -> None:
    """Q4_K/Q5_K at one token, and every type at two, take R = 8 when one wave of 8-row CTAs covers N, else 4 (Q5_1's
    long rows 2); on a 132-SM Hopper (the H200's sweeps; the K-quants', Q4_0's and Q4_1's at two tokens on an H100)
    that must give the sweeps' faster launch."""
    if sm_count(torch.cuda.current_device()) != H200_SMS:
        pytest.skip(f"the sweeps were measured on {H200_SMS}-SM GPUs")
    for qtype, faster in H200_FASTER.items():
        for n, k, want in zip(H200_SHAPES_N, H200_SHAPES_K, faster, strict=True):
            got = cuda_gguf.gemv_rows(qtype, 1, n, k)
            assert want is None or got == want, f"{qtype.name} N={n}: rule {got}, sweep {want}"
    for qtype, two in TWO_TOKEN_FASTER.items():
        for n, k, want in zip(H200_SHAPES_N, H200_SHAPES_K, two, strict=True):
            got = cuda_gguf.gemv_rows(qtype, 2, n, k)
            assert want is None or got == want, f"{qtype.name} two tokens N={n}: rule {got}, sweep {want}"
