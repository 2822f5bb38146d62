"""The decode GEMM over [K, N] weights (native/cuda/skinny_gemm_kn.cu) against a float64 matmul on random data."""

from __future__ import annotations

import pytest
import torch
from _cuda_helpers import REL_TOL, gemm_case, poison_allocator, rel_error

from candle_vllm.pyengine.ops import cuda, cuda_kn
from candle_vllm.pyengine.ops.activation import interleave_gate_up
from candle_vllm.pyengine.quant.unquantized import KN_ENV, UnquantizedLinear

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")



def kn_case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random x [m, k] and a weight stored [k, n]."""
    x, w = gemm_case(m, n, k, dtype, seed)
    return x, w.t().contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(64, 16), (192, 1040), (4096, 4096), (512, 14336)])
def test_matches_float64_with_the_default_launch(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    x, w = kn_case(m, n, k, dtype, seed=m * 1000 + n + k)
    poison_allocator(DEV, 16 * n * 4)
    got = cuda_kn.skinny_gemm_kn(x, w)
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_error(got, x.double() @ w.double()) < REL_TOL[dtype]


@pytest.mark.parametrize("stage_slabs", [1, 2, 4])
@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("splits", [1, 3, 16, 80])
@pytest.mark.parametrize("m", [2, 13])
def test_every_launch_choice_and_repeats(m: int, splits: int, warps: int, stage_slabs: int) -> None:
    """Each split, CTA size and stage depth (65 slabs: stages past the end, splits of one slab; 80 splits: the
    launcher drops the empty ones); serial split-K must leave its counters at zero for the next call."""
    x, w = kn_case(m, 320, 1040, torch.bfloat16, seed=splits + warps + stage_slabs)
    want = x.double() @ w.double()
    for _ in range(2):
        poison_allocator(DEV, 1 << 20)
        got = cuda_kn.skinny_gemm_kn(x, w, splits=splits, warps=warps, stage_slabs=stage_slabs)
        assert rel_error(got, want) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("splits", [None, 1, 5])
@pytest.mark.parametrize("m", [1, 9, 16])
@pytest.mark.parametrize("i,k", [(32, 48), (1024, 2048), (14336, 4096)])
def test_silu_mul_epilogue_equals_gemm_then_silu(i: int, k: int, m: int, splits: int | None) -> None:
    """Gate/up columns interleaved in groups of 8: the fused SwiGLU epilogue gives, bit for bit, the plain
    [gate | up] GEMM followed by the native silu_and_mul (a column's sum does not depend on its place in the strip)."""
    x, w = gemm_case(m, 2 * i, k, torch.bfloat16, seed=m + i + k)
    poison_allocator(DEV, 1 << 22)
    fused = cuda_kn.skinny_gemm_kn(x, interleave_gate_up(w).t().contiguous(), splits=splits, silu_mul=True)
    want = cuda.silu_and_mul(cuda_kn.skinny_gemm_kn(x, w.t().contiguous(), splits=splits))
    assert isinstance(want, torch.Tensor) and fused.shape == (m, i) and torch.equal(fused, want)


def test_inside_a_cuda_graph() -> None:
    """Split-K's counters and partials across graph replays (the decode path captures its GEMMs)."""
    x, w = kn_case(4, 4096, 4096, torch.bfloat16, seed=1)
    want = cuda_kn.skinny_gemm_kn(x, w, splits=8)  # the warm-up call outside capture creates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = cuda_kn.skinny_gemm_kn(x, w, splits=8)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(got, want)


def test_rejects_unsupported_input() -> None:
    x, w = kn_case(17, 64, 64, torch.bfloat16, seed=0)
    assert not cuda_kn.skinny_gemm_kn_supported(x, w)
    with pytest.raises(ValueError, match="M<=16"):
        cuda_kn.skinny_gemm_kn(x, w)
    x, w = kn_case(2, 96, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="N % 64"):
        cuda_kn.skinny_gemm_kn(x, w)
    x, w = kn_case(2, 64, 40, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="K % 16"):
        cuda_kn.skinny_gemm_kn(x, w)
    x, w = kn_case(2, 64, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="warps must be 4 or 8"):
        cuda_kn.skinny_gemm_kn(x, w, warps=6)
    with pytest.raises(ValueError, match="stage_slabs must be 1, 2 or 4"):
        cuda_kn.skinny_gemm_kn(x, w, stage_slabs=3)


@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_gate_up_layer_keeps_its_weight_kn(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A dense gate/up layer on CUDA holds [K, N]: decode batches take this kernel (SiLU fused), larger ones
    cuBLAS on the same weight; both layouts of the projection and the SwiGLU match the float64 reference."""
    monkeypatch.delenv(KN_ENV, raising=False)  # the default, whatever the runner's environment says
    i, k = 1024, 512
    x, w = gemm_case(m, 2 * i, k, torch.bfloat16, seed=m)
    layer = UnquantizedLinear(w, gate_up_interleaved=True)
    assert layer.kn and layer.weight.shape == (k, 2 * i)
    assert layer._decode_kernel(x) == ("skinny_kn" if m <= 16 else None)
    want = x.double() @ w.double().T
    assert rel_error(layer(x), want) < REL_TOL[torch.bfloat16]
    ref = torch.nn.functional.silu(want[:, :i]) * want[:, i:]
    swiglu = layer.forward_swiglu(x)
    assert swiglu is not None and rel_error(swiglu, ref) < REL_TOL[torch.bfloat16]


def test_norm_scale_folds_into_the_rows_of_a_kn_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    """``scale_input_columns`` scales input feature k: row k of a [K, N] weight, column k of [N, K]; the two
    layers then hold the same numbers."""
    _, w = gemm_case(1, 256, 128, torch.bfloat16, seed=3)
    scale = torch.rand(128, device=DEV) + 0.5
    monkeypatch.delenv(KN_ENV, raising=False)
    kn = UnquantizedLinear(w.clone(), gate_up_interleaved=True)
    monkeypatch.setenv(KN_ENV, "0")
    nk = UnquantizedLinear(w.clone(), gate_up_interleaved=True)
    assert kn.kn and not nk.kn
    kn.scale_input_columns(scale)
    nk.scale_input_columns(scale)
    assert torch.equal(kn.weight.t(), nk.weight)
