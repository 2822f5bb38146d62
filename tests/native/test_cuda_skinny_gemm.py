"""Skinny decode GEMM (tensor-core GEMV, M <= 16) against a float64 matmul on random data, and its add-norm
tail against the separate fused_add_rms_norm kernel (bit for bit) and a float64 reference."""

from __future__ import annotations

import functools

import pytest
import torch
from _cuda_helpers import REL_TOL, poison_allocator, rel_error

from candle_vllm.pyengine.ops import cuda, norm

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
EPS = 1e-5


@pytest.fixture(autouse=True)
def _needs_cuda_kernels() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEV) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1, 8), (37, 136), (1000, 1000), (4099, 4104), (517, 14336)])
def test_skinny_gemm_matches_float64(dtype: torch.dtype, m: int, n: int, k: int, warps: int) -> None:
    x, w = _case(m, n, k, dtype, seed=m * 1000 + n + k)
    poison_allocator(DEV, 16 * n * 4)
    got = cuda.skinny_gemm(x, w, warps=warps)
    want = x.double() @ w.double().T
    assert got.shape == (m, n) and got.dtype == dtype
    assert rel_error(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("m", [5, 16])
@pytest.mark.parametrize("splits", [1, 2, 5, 32, 40])
def test_split_k_gives_the_same_result_and_repeats(m: int, splits: int, warps: int) -> None:
    """Serial split-K elects a last CTA per tile through counters that must be left at zero for the next call
    (40 splits of 32 chunks: the launcher drops the empty ones; with 8 warps most warps of a split idle)."""
    x, w = _case(m, 333, 4096, torch.bfloat16, seed=splits)
    want = x.double() @ w.double().T
    for _ in range(3):
        poison_allocator(DEV, 1 << 20)
        got = cuda.skinny_gemm(x, w, splits=splits, warps=warps)
        assert rel_error(got, want) < REL_TOL[torch.bfloat16]


def test_skinny_gemm_rejects_unsupported_input() -> None:
    x, w = _case(17, 64, 64, torch.bfloat16, seed=0)
    assert not cuda.skinny_gemm_supported(x, w)
    with pytest.raises(ValueError, match="M<=16"):
        cuda.skinny_gemm(x, w)
    x, w = _case(2, 64, 60, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="K % 8"):
        cuda.skinny_gemm(x, w)
    x, w = _case(2, 64, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="warps must be 4 or 8"):
        cuda.skinny_gemm(x, w, warps=6)


# ---- add-norm tail: skinny_gemm(..., add_norm=...) == skinny_gemm then ops.norm.fused_add_rms_norm, bit for bit


@functools.cache
def _weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(n * 7 + k)
    return (torch.randn(n, k, generator=g, device=DEV) / k**0.5).to(dtype)


def _add_norm_inputs(
    m: int, n: int, k: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    residual = (3 * torch.randn(m, n, generator=g, device=DEV)).to(dtype)
    norm_w = (1 + 0.2 * torch.randn(n, generator=g, device=DEV)).to(dtype)
    return x, _weight(n, k, dtype), residual, norm_w


def _two_launches(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, splits: int | None, warps: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The path the tail replaces: the GEMM, then the native fused_add_rms_norm (in place on copies)."""
    y = cuda.skinny_gemm(x, w, splits=splits, warps=warps)
    out, res = norm.fused_add_rms_norm(y, residual.clone(), norm_w, EPS)
    assert isinstance(out, torch.Tensor)
    return out, res


def _fused(
    x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, splits: int | None, warps: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    res = residual.clone()
    poison_allocator(DEV, 1 << 20)
    return cuda.skinny_gemm(x, w, splits=splits, warps=warps, add_norm=(res, norm_w, EPS)), res


def _assert_bitwise(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    for g, w, what in zip(got, want, ("normed y", "residual"), strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        diff = (g != w).sum().item()
        assert diff == 0, f"{what}: {diff} of {g.numel()} elements differ, max |d| {(g.float() - w.float()).abs().max()}"


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (5120, 4096), (9216, 14336), (1000, 4096)])
def test_add_norm_tail_equals_gemm_then_norm(dtype: torch.dtype, m: int, n: int, k: int, warps: int) -> None:
    """9216 columns: the norm kernel's 1024 threads loop twice over a row's 1152 vectors, so the tail replays a
    virtual block with uneven trips; 5120: 640 vectors, 20 virtual warps; 1000: a partial last tile, 125 vectors
    (4 virtual warps, the last one part empty) and split-K from the heuristic."""
    x, w, residual, norm_w = _add_norm_inputs(m, n, k, dtype, seed=m * 31 + n + k + warps)
    assert cuda.skinny_add_norm_supported(x, w, residual, norm_w)
    got = _fused(x, w, residual, norm_w, None, warps)
    _assert_bitwise(got, _two_launches(x, w, residual, norm_w, None, warps))
    # and against an outside oracle: float64 GEMM + the torch reference of HF's RMSNorm
    want_res = x.double() @ w.double().T + residual.double()
    want = norm.rms_norm_reference(want_res, norm_w.double(), EPS)
    assert rel_error(got[1], want_res) < REL_TOL[dtype] and rel_error(got[0], want) < 2 * REL_TOL[dtype]


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("n,k,splits", [(512, 4096, None), (1024, 14336, None), (4096, 4096, 3), (4096, 14336, 7)])
def test_add_norm_tail_with_split_k(dtype: torch.dtype, m: int, n: int, k: int, splits: int | None, warps: int) -> None:
    """Only the CTA that finalises a tile counts toward the tail; small N gets split-K from the heuristic, the
    8B shapes are forced. Three calls in a row: the grid counter must be re-armed by each."""
    if splits is None:
        assert cuda.skinny_gemm_splits(n, k, cuda.sm_count(0), warps) > 1
    x, w, residual, norm_w = _add_norm_inputs(m, n, k, dtype, seed=m + n + k)
    want = _two_launches(x, w, residual, norm_w, splits, warps)
    for _ in range(3):
        _assert_bitwise(_fused(x, w, residual, norm_w, splits, warps), want)
    assert not cuda._split_counters(0).any(), "counters must be left at zero"


def test_add_norm_tail_refuses_unsupported_input() -> None:
    x, w, residual, norm_w = _add_norm_inputs(2, 1004, 512, torch.bfloat16, seed=1)
    assert not cuda.skinny_add_norm_supported(x, w, residual, norm_w)  # N % 8 != 0
    with pytest.raises(ValueError, match="N % 8 == 0"):
        cuda.skinny_gemm(x, w, add_norm=(residual, norm_w, EPS))
    x, w, residual, norm_w = _add_norm_inputs(cuda.ADD_NORM_MAX_M + 1, 512, 512, torch.bfloat16, seed=2)
    assert not cuda.skinny_add_norm_supported(x, w, residual, norm_w)
    x, w, residual, norm_w = _add_norm_inputs(2, 512, 512, torch.bfloat16, seed=3)
    assert cuda.skinny_add_norm_supported(x, w, residual, norm_w)
    assert not cuda.skinny_add_norm_supported(x, w, residual.half(), norm_w)
    assert not cuda.skinny_add_norm_supported(x, w, residual, norm_w[:256])
    assert not cuda.skinny_add_norm_supported(x, w, residual.t().contiguous().t(), norm_w)


def test_add_norm_tail_in_a_cuda_graph() -> None:
    """Capture two fused GEMMs back to back (the second's x is the first's normalised output and both update one
    residual, as o_proj -> norm -> ... does), replay on new inputs, compare with the eager two-launch chain."""
    m, n = 2, 4096
    x, w1, residual, nw1 = _add_norm_inputs(m, n, n, torch.bfloat16, seed=10)
    w2 = w1.flip(0).contiguous()  # a second weight of the same shape
    nw2 = nw1.flip(0).contiguous()

    def chain(x: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
        h = cuda.skinny_gemm(x, w1, add_norm=(res, nw1, EPS))
        return cuda.skinny_gemm(h, w2, add_norm=(res, nw2, EPS))

    def eager(x: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, res = _two_launches(x, w1, res, nw1, None, None)
        return _two_launches(h, w2, res, nw2, None, None)

    static_x, static_res = x.clone(), residual.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        chain(static_x, static_res.clone())  # warm-up outside capture creates the counters
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = chain(static_x, static_res)
    for seed in (11, 12, 13):
        new_x, _, new_res, _ = _add_norm_inputs(m, n, n, torch.bfloat16, seed=seed)
        static_x.copy_(new_x)
        static_res.copy_(new_res)
        graph.replay()
        torch.cuda.synchronize()
        _assert_bitwise((static_out, static_res), eager(new_x, new_res))
