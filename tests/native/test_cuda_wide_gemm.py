"""The Hopper decode GEMM (17..64 tokens) against a float64 matmul on random data, its SiLU epilogue against the GEMM
followed by silu_and_mul (bit for bit), CUDA-graph replay, and UnquantizedLinear sending 17..64-row batches of a
weight taller than one wave of its CTAs to it (and nothing else)."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from _cuda_helpers import REL_TOL, gemm_case, poison_allocator, rel_error

from candle_vllm.pyengine.ops import cuda, cuda_wide
from candle_vllm.pyengine.ops.activation import interleave_gate_up
from candle_vllm.pyengine.quant.unquantized import KN_ENV, UnquantizedLinear

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _needs_hopper() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
    if torch.cuda.get_device_capability(DEV)[0] != 9:
        pytest.skip("the wide GEMM runs on Hopper GPUs only")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 17, 33, 64])
@pytest.mark.parametrize("n,k", [(64, 64), (200, 264), (6144, 4096), (4096, 4104)])
def test_wide_gemm_matches_float64(dtype: torch.dtype, m: int, n: int, k: int) -> None:
    """Odd N (a partial last tile), K not a multiple of the 64-wide stage, tokens past M zero-filled by TMA."""
    x, w = gemm_case(m, n, k, dtype, seed=m + n + k)
    poison_allocator(DEV, m * n * 4)
    assert cuda_wide.wide_gemm_supported(x, w)
    got = cuda_wide.wide_gemm(x, w)
    assert got.shape == (m, n)
    assert rel_error(got, x.double() @ w.double().T) < REL_TOL[dtype]


def test_repeats_bit_for_bit() -> None:
    x, w = gemm_case(48, 1000, 264, torch.bfloat16, seed=7)
    assert torch.equal(cuda_wide.wide_gemm(x, w), cuda_wide.wide_gemm(x, w))


@pytest.mark.parametrize("m,i,k", [(64, 14336, 4096), (20, 200, 264), (1, 16, 64)])
def test_silu_mul_epilogue_equals_gemm_then_silu(m: int, i: int, k: int) -> None:
    x, w = gemm_case(m, 2 * i, k, torch.bfloat16, seed=i)
    fused = cuda_wide.wide_gemm(x, interleave_gate_up(w), silu_mul=True)
    want = cast(torch.Tensor, cuda.silu_and_mul(cuda_wide.wide_gemm(x, w)))
    assert fused.shape == (m, i) and torch.equal(fused, want)


def test_graph_replay_follows_new_inputs() -> None:
    x, w = gemm_case(64, 4096, 4096, torch.bfloat16, seed=3)
    cuda_wide.wide_gemm(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_wide.wide_gemm(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert rel_error(out, x.double() @ w.double().T) < REL_TOL[torch.bfloat16]


def test_linear_layer_sends_tall_weights_of_17_to_64_rows_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KN_ENV, "0")  # a gate/up weight kept [N, K], as the wide kernel reads it
    tall = 2 * 256 * cuda.sm_count(0)  # two full waves of 256-row tiles, as the LM head
    assert not cuda_wide.fills_waves(256 * cuda.sm_count(0) + 16, cuda.sm_count(0))  # a second wave of one tile
    _, w = gemm_case(1, tall, 64, torch.bfloat16, seed=5)
    gate_up = UnquantizedLinear(w, gate_up_interleaved=True)
    short = UnquantizedLinear(gemm_case(1, 512, 64, torch.bfloat16, seed=6)[1])
    for m, kernel in [(16, "skinny"), (17, "wide"), (64, "wide"), (65, None)]:
        x, _ = gemm_case(m, 1, 64, torch.bfloat16, seed=m)
        assert gate_up._decode_kernel(x) == kernel
        want = (x.double() @ w.double().T).float()
        assert rel_error(gate_up(x), want) < REL_TOL[torch.bfloat16]
        ref = torch.nn.functional.silu(want[:, : tall // 2]) * want[:, tall // 2 :]
        swiglu = gate_up.forward_swiglu(x)
        assert swiglu is not None
        assert rel_error(swiglu, ref) < REL_TOL[torch.bfloat16]
        assert short._decode_kernel(x) == ("skinny" if m <= 16 else None)
    monkeypatch.setenv(cuda_wide.ENV, "0")
    assert gate_up._decode_kernel(gemm_case(32, 1, 64, torch.bfloat16, seed=1)[0]) is None


def test_refuses_what_it_cannot_do() -> None:
    x, w = gemm_case(65, 64, 64, torch.bfloat16, seed=1)
    assert not cuda_wide.wide_gemm_supported(x, w)
    with pytest.raises(ValueError, match="M<=64"):
        cuda_wide.wide_gemm(x, w)
    x, w = gemm_case(8, 24, 64, torch.bfloat16, seed=2)
    with pytest.raises(ValueError, match="16k rows"):
        cuda_wide.wide_gemm(x, w, silu_mul=True)
