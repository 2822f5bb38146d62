"""The wgmma decode GEMM (M <= 64) against a float64 matmul on random data, its split-K, its SiLU epilogue
against the GEMM followed by silu_and_mul (bit for bit), and CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
from _cuda_helpers import REL_TOL, poison_allocator, rel_error

from candle_vllm.pyengine.ops import cuda, cuda_wide
from candle_vllm.pyengine.ops.activation import interleave_gate_up

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _needs_wgmma() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("the wgmma GEMM runs on Hopper GPUs only")


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=g, device=DEV) / k**0.5).to(dtype)
    return x, w


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 17, 33, 64])
@pytest.mark.parametrize("n,k", [(64, 64), (200, 264), (6144, 4096), (4096, 4104)])
def test_wide_gemm_matches_float64(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """Odd N (a partial last tile), K not a multiple of the 64-wide stage, tokens past M zero-filled."""
    x, w = _case(m, n, k, dtype, seed=m + n + k)
    poison_allocator(DEV, m * n * 4)
    assert cuda_wide.wide_gemm_supported(x, w)
    got = cuda_wide.wide_gemm(x, w)
    assert got.shape == (m, n)
    assert rel_error(got, x.double() @ w.double().T) < REL_TOL[dtype]


@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_split_k_agrees_and_rearms_its_counters(splits: int) -> None:
    x, w = _case(48, 4096, 14336, torch.bfloat16, seed=splits)
    want = x.double() @ w.double().T
    first = cuda_wide.wide_gemm(x, w, splits=splits)
    assert rel_error(first, want) < REL_TOL[torch.bfloat16]
    assert torch.equal(cuda_wide.wide_gemm(x, w, splits=splits), first)  # counters were left at zero


@pytest.mark.parametrize("m,i,k,splits", [(64, 14336, 4096, None), (20, 200, 264, 3), (1, 16, 64, 1)])
def test_silu_mul_epilogue_equals_gemm_then_silu(m: int, i: int, k: int, splits: int | None) -> None:
    x, w = _case(m, 2 * i, k, torch.bfloat16, seed=i)
    fused = cuda_wide.wide_gemm(x, interleave_gate_up(w), splits=splits, silu_mul=True)
    want = cuda.silu_and_mul(cuda_wide.wide_gemm(x, w, splits=splits))
    assert fused.shape == (m, i) and torch.equal(fused, want)


def test_graph_replay_follows_new_inputs() -> None:
    x, w = _case(64, 4096, 4096, torch.bfloat16, seed=3)
    cuda_wide.wide_gemm(x, w)  # split counters exist before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_wide.wide_gemm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_error(out, x.double() @ w.double().T) < REL_TOL[torch.bfloat16]


def test_refuses_what_it_cannot_do() -> None:
    x, w = _case(65, 64, 64, torch.bfloat16, seed=1)
    assert not cuda_wide.wide_gemm_supported(x, w)
    with pytest.raises(ValueError, match="M<=64"):
        cuda_wide.wide_gemm(x, w)
    x, w = _case(8, 24, 64, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="16k rows"):
        cuda_wide.wide_gemm(x, w, silu_mul=True)
