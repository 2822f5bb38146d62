"""The interleaved gate/up layout (the skinny GEMM's fused-SiLU weight format) against the plain [gate; up] one,
on CPU: the layout helpers and a dense linear method holding an interleaved weight. Integer-valued data keeps
every matmul exact, so the projections compare bit for bit whatever order a BLAS sums in; the SiLU outputs are
compared to 1 ulp of f32 (torch's CPU SiLU rounds differently on strided and contiguous operands)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops.activation import (
    deinterleave_gate_up,
    interleave_gate_up,
    silu_and_mul,
    silu_and_mul_interleaved,
)
from candle_vllm.pyengine.quant.unquantized import UnquantizedLinear


def _ints(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()


@pytest.mark.parametrize("i,k,m", [(16, 16, 1), (24, 40, 3), (1000, 64, 7)])
def test_interleaved_projection_gives_the_plain_swiglu(i: int, k: int, m: int) -> None:
    gate, up, x = _ints(i, k, seed=1), _ints(i, k, seed=2), _ints(m, k, seed=3) / 4
    w = torch.cat([gate, up])
    wi = interleave_gate_up(w)
    assert wi.shape == w.shape and not torch.equal(wi, w)
    assert torch.equal(wi[:8], gate[:8]) and torch.equal(wi[8:16], up[:8])  # one 16-row tile: 8 gate, 8 up
    y, yi = F.linear(x, w), F.linear(x, wi)
    assert torch.equal(deinterleave_gate_up(yi), y)
    torch.testing.assert_close(silu_and_mul_interleaved(yi), silu_and_mul(y), rtol=2e-7, atol=0)


def test_interleaving_needs_whole_groups() -> None:
    with pytest.raises(ValueError, match="blocks of 16k rows"):
        interleave_gate_up(torch.zeros(24, 4))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dense_method_with_an_interleaved_weight(dtype: torch.dtype) -> None:
    gate, up, x = _ints(16, 32, seed=4), _ints(16, 32, seed=5), _ints(5, 32, seed=6) / 4
    w = torch.cat([gate, up]).to(dtype)
    plain, inter = UnquantizedLinear(w.clone()), UnquantizedLinear(w.clone(), gate_up_interleaved=True)
    x = x.to(dtype)
    assert torch.equal(inter(x), plain(x))  # forward keeps the [gate, up] layout
    assert plain.forward_swiglu(x) is None  # no fused form: the caller applies silu_and_mul
    torch.testing.assert_close(inter.forward_swiglu(x), silu_and_mul(plain(x)), rtol=2e-7 if dtype == torch.float32 else 0, atol=0)
