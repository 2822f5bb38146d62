"""The int8 tensor-core GGUF product for decode batches (``cuda_gguf.mmq``, native/cuda/gguf_mmq.cu and, for up to
8 tokens, gguf_mmq_staged.cu).

Oracles: the `gguf` package's dequantizer (W64) and a torch re-implementation of the activation rounding (x8: one
scale per 32 values, per 256 for the K-quants), with the dp4a GEMV's bounds (``assert_dp4a_within``: int8 codes,
exact integer dot products, f32 scaling). Properties: a token's result does not depend on the other tokens of its
launch (bit for bit across batch compositions), codes handed over by a producer give the bits of the kernel's own
quantizer (and codes of the other scale group are not taken), the staged kernel gives the register kernel's bits,
and ``ops.quant.quant_matmul`` sends batches of ``mmq_min_rows(qtype, out_features)``..32 rows of a type with the kernel
to it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from _cuda_helpers import poison_allocator
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT
from test_cuda_gguf import assert_dp4a_within, device_blocks, oracle, random_blocks
from torch.profiler import ProfilerActivity, profile

from candle_vllm.pyengine.ops import cuda_gguf, native, quant
from candle_vllm.pyengine.ops.norm import rms_norm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
MMQ_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
ROWS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32]
K_QUANTS = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}
GROUP = {q: 256 if q in K_QUANTS else 32 for q in MMQ_TYPES}  # activation values per scale (Q8_K's rule for K)



def _weight(qtype: QT, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(qtype, n, k, seed=seed)
    return device_blocks(raw, qtype), oracle(raw, qtype, n, k).double()


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mmq_matches_float64(qtype: QT, dtype: torch.dtype) -> None:
    """Odd N (a partial 16-row tile), K of 5 x 256 (split unevenly over the CTA's 4 warps), every token tile; the
    32-element types' units of two blocks start 2 bytes off a word in every other unit."""
    n, k = 333, 5 * 256
    data, w64 = _weight(qtype, n, k, seed=200 + int(qtype))
    g = torch.Generator().manual_seed(int(qtype))
    for m in ROWS:
        x = torch.randn(m, k, generator=g).to(dtype)
        poison_allocator(DEV, 32 * n * 4)
        got = cuda_gguf.mmq(x.to(DEV), data, qtype, n, k)
        assert got.shape == (m, n) and got.dtype == dtype
        assert_dp4a_within(got, x, w64, GROUP[qtype])


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
def test_a_token_does_not_depend_on_its_batch(qtype: QT) -> None:
    """The rows of a 32-token launch equal the same rows launched in 9- and 17-token batches, and those of an 8-token
    launch the same rows in 1- and 3-token batches, bit for bit (batches of up to 8 tokens may take other warps:
    gguf_mmq.cu's staged_warps)."""
    n, k = 1000, 4096
    data, _ = _weight(qtype, n, k, seed=3)
    x = torch.randn(32, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEV)
    full = cuda_gguf.mmq(x, data, qtype, n, k)
    for lo, hi in ((0, 9), (5, 22), (12, 28)):
        assert torch.equal(cuda_gguf.mmq(x[lo:hi], data, qtype, n, k), full[lo:hi]), f"rows {lo}..{hi}"
    eight = cuda_gguf.mmq(x[24:], data, qtype, n, k)
    for lo, hi in ((31, 32), (26, 29)):
        assert torch.equal(cuda_gguf.mmq(x[lo:hi], data, qtype, n, k), eight[lo - 24 : hi - 24]), f"rows {lo}..{hi}"
    warps = native.loaded().cuda_gguf_mmq_warps
    if warps(int(qtype), 8, n, k) == warps(int(qtype), 32, n, k):  # then both sizes sum in one order
        assert torch.equal(eight, full[24:])


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
def test_row_tiling_keeps_the_bits_and_warps_keep_the_bounds(qtype: QT) -> None:
    """16 or 32 weight rows per CTA (N = 200 leaves each a partial last tile) change only the speed; 4, 8 or 16 warps
    splitting K sum in another order, within the same bounds (16 with one row tile only: two are refused)."""
    n, k = 200, 3 * 256
    data, w64 = _weight(qtype, n, k, seed=6)
    g = torch.Generator().manual_seed(6)
    for m in (5, 16, 29):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for warps in (4, 8, 16):
            want = cuda_gguf.mmq(x.to(DEV), data, qtype, n, k, row_tiles=1, warps=warps)
            assert_dp4a_within(want, x, w64, GROUP[qtype])
            if warps != 16:
                got = cuda_gguf.mmq(x.to(DEV), data, qtype, n, k, row_tiles=2, warps=warps)
                assert torch.equal(got, want), (m, warps)
    x = torch.randn(4, k, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="row_tiles must be"):
        cuda_gguf.mmq(x, data, qtype, n, k, row_tiles=4)
    with pytest.raises(ValueError, match="warps must be"):
        cuda_gguf.mmq(x, data, qtype, n, k, warps=2)
    with pytest.raises(ValueError, match="16 warps take one row tile"):
        cuda_gguf.mmq(x, data, qtype, n, k, row_tiles=2, warps=16)


def _rule_warps(qtype: QT, n: int, k: int) -> int:
    """gguf_mmq.cu's staged_warps, restated: 8 where the 32-row grid has fewer CTAs than the device has SMs, else 4;
    16 for Q8_0 on narrow weights, Q4_0/Q4_1 on short narrow rows, Q5_0 on short narrow rows of a full grid, Q2_K/Q3_K
    on narrow weights of a small grid."""
    few = (n + 31) // 32 < torch.cuda.get_device_properties(DEV).multi_processor_count
    warps = 8 if few else 4
    if n >= 16384:
        return warps
    long_rows = k >= 8192
    sixteen = {QT.Q8_0: True, QT.Q4_0: not long_rows, QT.Q4_1: not long_rows, QT.Q5_0: not long_rows and not few,
               QT.Q2_K: few, QT.Q3_K: few}
    return 16 if sixteen.get(qtype, False) else warps


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
def test_the_default_warps_per_type_and_shape(qtype: QT) -> None:
    """The warps of a default launch (``cuda_gguf_mmq_warps``, which shares the launch's rule_warps): gguf_mmq.cu's
    rule (_rule_warps) for the staged kernel's batches of up to 8 tokens on a Hopper GPU, the register kernel's (8 on
    a small grid, else 4) elsewhere; an explicit launch with those warps gives the default launch's bits (bf16 outputs
    of other warp orders mostly round alike too, so this pins the kernel path, not the warps); a type without a
    kernel or more than 32 tokens is refused."""
    g = torch.Generator().manual_seed(9)
    for n, k in ((1000, 4096), (4352, 4096), (1000, 8448), (16400, 4096)):
        few = (n + 31) // 32 < torch.cuda.get_device_properties(DEV).multi_processor_count
        for m in (3, 12):
            want = _rule_warps(qtype, n, k) if quant.staged_mmq_runs(qtype, k) and m <= 8 else 8 if few else 4
            assert native.loaded().cuda_gguf_mmq_warps(int(qtype), m, n, k) == want, (n, k, m)
    n, k = 1000, 4096
    data, _ = _weight(qtype, n, k, seed=9)
    for m in (3, 12):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
        warps = native.loaded().cuda_gguf_mmq_warps(int(qtype), m, n, k)
        assert torch.equal(cuda_gguf.mmq(x, data, qtype, n, k), cuda_gguf.mmq(x, data, qtype, n, k, warps=warps))
    with pytest.raises(ValueError, match=r"M must be in 1\.\.32"):
        native.loaded().cuda_gguf_mmq_warps(int(qtype), 33, n, k)
    with pytest.raises(ValueError, match="no tensor-core kernel"):
        native.loaded().cuda_gguf_mmq_warps(int(QT.IQ4_NL), 1, n, k)


# The staged kernel runs on Hopper only (elsewhere the register kernel takes every batch); on a Hopper these tests
# run, so a wrong run check fails them rather than skipping them.
needs_hopper = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9,
    reason="the staged kernel runs on Hopper (sm_90) GPUs only",
)


# K values whose last chunk is partial in a ring that wraps: long rows whose tokens are staged (2-stage rings), Q8_0's
# long rows (a 3-stage ring, tokens prefetched), the short rows of Q4_1 and Q8_0 (2 x 512 x 96K, 4 and 5 stages;
# 4352 = 5 and 9 chunks) and Q4_K's (2 stages with 8 warps); a partial last chunk for the other loops too (Q5_K 8448,
# Q2_K 3072, Q4_0 4352), fewer units than warps (256), a second chunk for Q6_K and Q3_K (4096)
PARTIAL_CHUNK_K = {QT.Q8_0: (4352, 8448), QT.Q4_0: (8448, 4352), QT.Q4_1: (8448, 4352), QT.Q5_1: (8448,),
                   QT.Q4_K: (4352, 256), QT.Q5_K: (8448, 256), QT.Q2_K: (3072,), QT.Q6_K: (4096,), QT.Q3_K: (4096,)}


def _row_bytes_fit(qtype: QT, k: int) -> bool:
    """Whether a row of k values is a whole number of 16-byte granules (the staged kernel's bulk copies)."""
    block, size = GGML_QUANT_SIZES[qtype]
    return k // block * size % 16 == 0


@needs_hopper
@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
def test_staged_kernel_gives_the_register_kernels_bits(qtype: QT) -> None:
    """The kernel that streams the weights through shared memory (staging 2) sums as the register kernel (staging 1)
    with the same warps: 1-8 tokens, N = 333 (a partial 16-row tile), K of 14336 (the ring wraps several times),
    10240 (long rows too) and 2048 (short rows, which take other layouts than long ones), and where a layout needs
    it a K whose last chunk is partial with a ring that wraps (PARTIAL_CHUNK_K), bit for bit, within the float64
    bounds."""
    n = 333
    g = torch.Generator().manual_seed(40 + int(qtype))
    for k in (14336, 10240, 2048, *PARTIAL_CHUNK_K.get(qtype, ())):
        assert _row_bytes_fit(qtype, k)
        data, w64 = _weight(qtype, n, k, seed=int(qtype) + k)
        for m in (1, 2, 3, 5, 8):
            x = torch.randn(m, k, generator=g).to(torch.bfloat16)
            for warps in (4, 8, 16):
                poison_allocator(DEV, 8 * n * 4)
                got = cuda_gguf.mmq(x.to(DEV), data, qtype, n, k, warps=warps, staging=2)
                want = cuda_gguf.mmq(x.to(DEV), data, qtype, n, k, row_tiles=1, warps=warps, staging=1)
                assert torch.equal(got, want), (k, m, warps)
            assert_dp4a_within(got, x, w64, GROUP[qtype])


@needs_hopper
@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
def test_staged_kernel_on_wide_weights(qtype: QT) -> None:
    """Weights of 16384 rows or more take the wide staging (32-row CTAs for all types but Q6_K, most prefetching their
    tokens): N = 16400 leaves a partial tile, K = 4096 is two chunks or more; still the register kernel's bits, and
    rows sampled across the weight within the float64 bounds."""
    n, k = 16400, 4096
    raw = random_blocks(qtype, n, k, seed=70 + int(qtype))
    data = device_blocks(raw, qtype)
    rows = torch.tensor([0, 1, 15, 16, 31, 8191, 16383, 16384, 16399])
    w64 = oracle(raw[rows.numpy()], qtype, len(rows), k).double()
    g = torch.Generator().manual_seed(71)
    for m in (1, 3, 8):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        got = cuda_gguf.mmq(x.to(DEV), data, qtype, n, k, staging=2)
        assert torch.equal(got, cuda_gguf.mmq(x.to(DEV), data, qtype, n, k, row_tiles=1, staging=1)), m
        assert_dp4a_within(got[:, rows.to(DEV)], x, w64, GROUP[qtype])


@needs_hopper
def test_batches_up_to_8_take_the_staged_kernel() -> None:
    """The default rule: the staged kernel for 1-8 tokens whose rows it can copy, the register kernel above 8 tokens
    and for rows that are no whole number of 16-byte granules (Q3_K at K = 1280: 550 bytes), where ops.quant then
    reads the register kernel's thresholds."""
    def kernels(qtype: QT, m: int, k: int) -> set[str]:
        data, _ = _weight(qtype, 64, k, seed=11)
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            cuda_gguf.mmq(x, data, qtype, 64, k)
            torch.cuda.synchronize()
        return {e.name for e in prof.events() if "gguf_mmq" in e.name and "kernel" in e.name}

    assert not _row_bytes_fit(QT.Q3_K, 1280)
    assert quant.staged_mmq_runs(QT.Q3_K, 2048) and not quant.staged_mmq_runs(QT.Q3_K, 1280)
    assert quant.mmq_min_rows(QT.Q3_K, 64, 2048) == quant.MMQ_MIN_ROWS[QT.Q3_K][0]
    assert quant.mmq_min_rows(QT.Q3_K, 64, 1280) == quant.MMQ_MIN_ROWS_REGISTERS[QT.Q3_K][0]
    for qtype, m, k, staged in ((QT.Q4_K, 1, 1024, True), (QT.Q4_K, 8, 1024, True), (QT.Q4_K, 9, 1024, False),
                                (QT.Q3_K, 4, 2048, True), (QT.Q3_K, 4, 1280, False)):
        names = kernels(qtype, m, k)
        assert len(names) == 1 and ("gguf_mmq_staged_kernel" in next(iter(names))) == staged, (qtype, m, k, names)


@needs_hopper
def test_the_staged_kernel_refuses_what_it_cannot_do() -> None:
    """Asked for by name (staging 2), the staged kernel refuses more than 8 tokens, a row-tile choice and rows that are
    no whole number of 16-byte granules, each with its reason; staging takes 0, 1 or 2."""
    data, _ = _weight(QT.Q3_K, 16, 1280, seed=12)
    x = torch.randn(4, 1280, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"staged kernel takes 1\.\.8 tokens"):
        cuda_gguf.mmq(x, data, QT.Q3_K, 16, 1280, staging=2)
    data, _ = _weight(QT.Q4_K, 16, 1280, seed=12)
    with pytest.raises(ValueError, match=r"staged kernel takes 1\.\.8 tokens"):
        cuda_gguf.mmq(torch.randn(9, 1280, device=DEV, dtype=torch.bfloat16), data, QT.Q4_K, 16, 1280, staging=2)
    for row_tiles in (1, 2):
        with pytest.raises(ValueError, match="row_tiles is the register kernel's launch choice"):
            cuda_gguf.mmq(x, data, QT.Q4_K, 16, 1280, row_tiles=row_tiles, staging=2)
    with pytest.raises(ValueError, match="staging must be"):
        cuda_gguf.mmq(x, data, QT.Q4_K, 16, 1280, staging=3)
    assert cuda_gguf.mmq(x, data, QT.Q4_K, 16, 1280, staging=2).shape == (4, 16)


def test_the_scale_group_per_type() -> None:
    assert {q: cuda_gguf.x_group(q) for q in MMQ_TYPES} == GROUP


@pytest.mark.parametrize("qtype", MMQ_TYPES, ids=lambda t: t.name)
def test_codes_from_a_producer_equal_the_own_quantizer(qtype: QT) -> None:
    """RMSNorm's int8 codes of the type's scale group (a Q8Activation) give the bits of mmq on the dense normed
    rows; codes of the other group are not taken (the dense rows are quantized again, same bits)."""
    n, k, m = 520, 2048, 24
    data, _ = _weight(qtype, n, k, seed=9)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).to(DEV)
    w = (torch.rand(k, generator=g) + 0.5).to(torch.bfloat16).to(DEV)
    act = rms_norm(x, w, 1e-5, q8=GROUP[qtype])
    assert isinstance(act, Q8Activation) and act.group == GROUP[qtype]
    want = cuda_gguf.mmq(act.x, data, qtype, n, k)
    assert torch.equal(cuda_gguf.mmq(act, data, qtype, n, k), want)
    other = rms_norm(x, w, 1e-5, q8=288 - GROUP[qtype])
    assert isinstance(other, Q8Activation) and torch.equal(other.x, act.x)
    assert torch.equal(cuda_gguf.mmq(other, data, qtype, n, k), want)


@pytest.mark.parametrize("qtype", [QT.Q4_K, QT.Q4_0, QT.Q5_0], ids=lambda t: t.name)
def test_quant_matmul_takes_mmq_from_its_min_rows_to_32(qtype: QT, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below mmq_min_rows(qtype, n) rows the dp4a GEMV (in 8-row passes above 8), from there to 32 rows one mmq launch,
    33 dequantize for cuBLAS; CANDLE_VLLM_GGUF_MMQ=0 sends 12 rows back to 8-row dp4a passes."""
    n, k = 300, 1024
    data, w64 = _weight(qtype, n, k, seed=4)
    monkeypatch.delenv("CANDLE_VLLM_GGUF_MMQ", raising=False)
    quant.mmq_enabled.cache_clear()
    mod = native.loaded()
    calls: list[str] = []
    for name in ("cuda_gguf_mmq", "cuda_gguf_gemv_q8", "cuda_gguf_dequantize"):
        real = getattr(mod, name)

        def counted(*a: Any, _r: Any = real, _n: str = name) -> Any:
            calls.append(_n)
            return _r(*a)

        monkeypatch.setattr(mod, name, counted)
    g = torch.Generator().manual_seed(1)
    low = quant.mmq_min_rows(qtype, n, k)
    assert low is not None
    below = ["cuda_gguf_gemv_q8"] * -(-(low - 1) // mod.cuda_gguf_gemv_max_m)
    for m, want in ((low - 1, below), (low, ["cuda_gguf_mmq"]), (32, ["cuda_gguf_mmq"]),
                    (33, ["cuda_gguf_dequantize"])):
        calls.clear()
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        got = quant.quant_matmul(x.to(DEV), data, qtype, n, k)
        assert calls == want, (m, calls)
        if m <= 32:
            assert_dp4a_within(got, x, w64, GROUP[qtype] if m >= low else 32)
    monkeypatch.setenv("CANDLE_VLLM_GGUF_MMQ", "0")
    quant.mmq_enabled.cache_clear()
    try:
        calls.clear()
        quant.quant_matmul(torch.randn(12, k, device=DEV, dtype=torch.bfloat16), data, qtype, n, k)
        assert calls == ["cuda_gguf_gemv_q8"] * 2, calls
    finally:
        monkeypatch.delenv("CANDLE_VLLM_GGUF_MMQ")
        quant.mmq_enabled.cache_clear()


def test_the_types_with_a_kernel() -> None:
    """Every int8-activation type has the tensor-core product."""
    mod = native.loaded()
    have = [q for q in QT if mod.cuda_gguf_mmq_supported(int(q))]
    assert sorted(have) == sorted(MMQ_TYPES) == sorted(quant.MMQ_MIN_ROWS)
    assert have == [q for q in QT if cuda_gguf.dp4a_supported(q)]


def test_mmq_refuses_what_it_cannot_do() -> None:
    """The Python checks (type, rows) and the native ones (K in whole 256-value blocks, 16-byte aligned blocks,
    the launch choice), each with its reason and nothing launched."""
    data, _ = _weight(QT.Q4_K, 16, 256, seed=1)
    x = torch.randn(12, 256, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="IQ4_NL data"):
        cuda_gguf.mmq(x, data, QT.IQ4_NL, 16, 256)
    with pytest.raises(ValueError, match=r"got x \(33, 256\)"):
        cuda_gguf.mmq(torch.randn(33, 256, device=DEV, dtype=torch.bfloat16), data, QT.Q4_K, 16, 256)
    mod = native.loaded()
    y = torch.empty(12, 16, device=DEV, dtype=torch.bfloat16)
    xq = torch.empty(12 * 512, device=DEV, dtype=torch.int8)
    xb = torch.empty(12 * 512 // 32 * 8 + 16, device=DEV, dtype=torch.uint8)
    w2, _ = _weight(QT.Q4_K, 16, 512, seed=2)

    def call(k: int, xb_ptr: int, row_tiles: int = 0, warps: int = 0) -> None:
        mod.cuda_gguf_mmq(y.data_ptr(), 0, xq.data_ptr(), xb_ptr, w2.data_ptr(), 12, 16, k, int(QT.Q4_K),
                          native.dtype_code(y), native.stream(DEV), row_tiles, warps)

    with pytest.raises(ValueError, match="multiple of 256"):
        call(288, xb.data_ptr())
    with pytest.raises(ValueError, match="16-byte aligned"):
        call(512, xb.data_ptr() + 8)
    with pytest.raises(ValueError, match="row_tiles must be"):
        call(512, xb.data_ptr(), row_tiles=3)
    with pytest.raises(ValueError, match="warps must be"):
        call(512, xb.data_ptr(), warps=12)
    call(512, xb.data_ptr())  # the same operands, accepted
    torch.cuda.synchronize()


def test_misaligned_codes_are_requantized() -> None:
    """A Q8Activation whose blocks sit 8 bytes off a 16-byte boundary gives the bits of the dense path."""
    n, k, m = 64, 512, 10
    data, _ = _weight(QT.Q4_K, n, k, seed=8)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16).to(DEV)
    act = rms_norm(x, torch.ones(k, device=DEV, dtype=torch.bfloat16), 1e-5, q8=256)
    assert isinstance(act, Q8Activation)
    shifted = torch.empty(act.xb.numel() + 8, device=DEV, dtype=torch.uint8)[8:].view(act.xb.shape)
    shifted.copy_(act.xb)
    got = cuda_gguf.mmq(Q8Activation(act.x, act.xq, shifted, 256), data, QT.Q4_K, n, k)
    assert torch.equal(got, cuda_gguf.mmq(act.x, data, QT.Q4_K, n, k))
