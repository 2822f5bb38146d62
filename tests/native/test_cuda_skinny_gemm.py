"""Skinny decode GEMM (tensor-core GEMV, M <= 16) against a float64 matmul on random data."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from _cuda_helpers import REL_TOL, gemm_case, poison_allocator, rel_error

from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.ops.activation import (
    deinterleave_gate_up,
    interleave_gate_up,
    silu_and_mul_interleaved,
)

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")



@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1, 8), (37, 136), (1000, 1000), (4099, 4104), (517, 14336)])
def test_skinny_gemm_matches_float64(dtype: torch.dtype, m: int, n: int, k: int, warps: int) -> None:
    x, w = gemm_case(m, n, k, dtype, seed=m * 1000 + n + k)
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
    x, w = gemm_case(m, 333, 4096, torch.bfloat16, seed=splits)
    want = x.double() @ w.double().T
    for _ in range(3):
        poison_allocator(DEV, 1 << 20)
        got = cuda.skinny_gemm(x, w, splits=splits, warps=warps)
        assert rel_error(got, want) < REL_TOL[torch.bfloat16]


def test_skinny_gemm_rejects_unsupported_input() -> None:
    x, w = gemm_case(17, 64, 64, torch.bfloat16, seed=0)
    assert not cuda.skinny_gemm_supported(x, w)
    with pytest.raises(ValueError, match="M<=16"):
        cuda.skinny_gemm(x, w)
    x, w = gemm_case(2, 64, 60, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="K % 8"):
        cuda.skinny_gemm(x, w)
    x, w = gemm_case(2, 64, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="warps must be 4 or 8"):
        cuda.skinny_gemm(x, w, warps=6)


@pytest.mark.parametrize("warps", [4, 8])
@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("m", [1, 5, 9, 16])
@pytest.mark.parametrize("i,k", [(8, 136), (1000, 1000), (14336, 4096)])
def test_silu_mul_epilogue_equals_gemm_then_silu(i: int, k: int, m: int, splits: int | None, warps: int) -> None:
    """The fused SwiGLU epilogue on an interleaved gate/up weight gives, bit for bit, the plain [gate; up] GEMM
    followed by the native silu_and_mul (every row's dot product is summed the same way in either layout, and
    both round gate and up to the dtype before the SiLU); split-K and both CTA sizes."""
    x, w = gemm_case(m, 2 * i, k, torch.bfloat16, seed=m + i + k)
    poison_allocator(DEV, 1 << 22)
    fused = cuda.skinny_gemm(x, interleave_gate_up(w), splits=splits, warps=warps, silu_mul=True)
    want = cast(torch.Tensor, cuda.silu_and_mul(cuda.skinny_gemm(x, w, splits=splits, warps=warps)))
    assert fused.shape == (m, i) and torch.equal(fused, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,i", [(1, 8), (7, 1000), (300, 14336)])
def test_interleaved_silu_kernel(dtype: torch.dtype, tokens: int, i: int) -> None:
    """silu_and_mul over an interleaved projection output equals the plain kernel on the de-interleaved one."""
    g = torch.Generator(device=DEV).manual_seed(tokens + i)
    y = (torch.randn(tokens, 2 * i, generator=g, device=DEV) * 3).to(dtype)
    got = cuda.silu_and_mul_interleaved(y)
    assert got is not None and torch.equal(got, cast(torch.Tensor, cuda.silu_and_mul(deinterleave_gate_up(y))))
    assert torch.equal(silu_and_mul_interleaved(y), got)  # the op dispatcher takes the kernel


def test_silu_mul_needs_whole_row_groups() -> None:
    x, w = gemm_case(2, 24, 64, torch.bfloat16, seed=0)
    with pytest.raises(ValueError, match="16k rows"):
        cuda.skinny_gemm(x, w, silu_mul=True)
