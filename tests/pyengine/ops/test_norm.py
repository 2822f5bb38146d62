"""Native RMSNorm kernels against the torch reference on random data."""

from __future__ import annotations

import pytest
import torch

from candle_vllm.pyengine.ops import native, norm

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


@pytest.fixture(autouse=True)
def _needs_native() -> None:
    if native.module() is None:
        pytest.fail("candle_vllm._native is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (33, 4097)])
def test_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    w = torch.randn(hidden, generator=g).to(dtype)
    got = norm.rms_norm(x, w, 1e-6)
    want = norm.rms_norm_reference(x, w, 1e-6)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(9, 300, generator=g).to(dtype)
    r = torch.randn(9, 300, generator=g).to(dtype)
    w = torch.randn(300, generator=g).to(dtype)
    want_out, want_res = norm.fused_add_rms_norm_reference(x.clone(), r.clone(), w, 1e-5)
    got_out, got_res = norm.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    torch.testing.assert_close(got_res, want_res, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got_out.float(), want_out.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_of_strided_heads_is_batch_invariant(dtype: torch.dtype) -> None:
    """q/k norms get head views cut from a fused qkv row; a step's result per token must not depend on how many
    tokens share the step (a one-token view is contiguous, a many-token view is not)."""
    g = torch.Generator().manual_seed(5)
    t, heads, d = 9, 6, 128
    qkv = (torch.randn(t, 3 * heads * d, generator=g) * 2).to(dtype)
    q = qkv[:, : heads * d].view(t, heads, d)
    assert not q.is_contiguous() and q[:1].is_contiguous()
    w = torch.randn(d, generator=g).to(dtype)
    together = norm.rms_norm(q, w, 1e-6)
    alone = torch.cat([norm.rms_norm(q[i : i + 1], w, 1e-6) for i in range(t)])
    assert torch.equal(together, alone)
