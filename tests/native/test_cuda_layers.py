"""CUDA RMSNorm, SiLU-and-mul and RoPE against torch references on random data."""

from __future__ import annotations

from typing import cast

import pytest
import torch
import torch.nn.functional as F
from _cuda_helpers import REL_TOL, poison_allocator, rel_error

from candle_vllm.pyengine.ops import cuda, cuda_rotary, norm

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]



def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 576), (33, 4097), (5, 8192)])
def test_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = _gen(rows * hidden)
    x = (torch.randn(rows, hidden, generator=g, device=DEV) * 3).to(dtype)
    w = torch.randn(hidden, generator=g, device=DEV).to(dtype)
    poison_allocator(DEV, rows * hidden)
    got = norm.rms_norm(x, w, 1e-6)
    want = norm.rms_norm_reference(x.double(), w.double(), 1e-6)
    assert rel_error(got, want) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(9, 300), (4, 4096), (2, 20480)])
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = _gen(hidden)
    x = torch.randn(rows, hidden, generator=g, device=DEV).to(dtype)
    r = torch.randn(rows, hidden, generator=g, device=DEV).to(dtype)
    w = torch.randn(hidden, generator=g, device=DEV).to(dtype)
    want_out, want_res = norm.fused_add_rms_norm_reference(x.double(), r.double(), w.double(), 1e-5)
    got_out, got_res = norm.fused_add_rms_norm(x.clone(), r.clone(), w, 1e-5)
    assert rel_error(got_res, want_res) < REL_TOL[dtype]
    assert rel_error(got_out, want_out) < REL_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,d", [(1, 8), (3, 1001), (64, 14336)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, tokens: int, d: int) -> None:
    x = (torch.randn(tokens, 2 * d, generator=_gen(d), device=DEV) * 4).to(dtype)
    poison_allocator(DEV, tokens * d)
    got = cast("torch.Tensor | None", cuda.silu_and_mul(x))
    xd = x.double()
    want = F.silu(xd[:, :d]) * xd[:, d:]
    assert got is not None and got.shape == (tokens, d)
    assert rel_error(got, want) < REL_TOL[dtype]


def _rope_reference(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, neox: bool) -> torch.Tensor:
    """float64 rotation of the first table-width channels (cos/sin first rounded to x's dtype)."""
    rot = table.shape[-1]
    cos, sin = table[pos].to(x.dtype).double().unsqueeze(1).chunk(2, dim=-1)
    out = x.double().clone()
    xr = out[..., :rot]
    if neox:
        x1, x2 = xr[..., : rot // 2].clone(), xr[..., rot // 2 :].clone()
        xr[..., : rot // 2], xr[..., rot // 2 :] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    else:
        x1, x2 = xr[..., 0::2].clone(), xr[..., 1::2].clone()
        xr[..., 0::2], xr[..., 1::2] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_dim,rot", [(128, 128), (64, 32), (80, 80), (72, 36)])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, neox: bool, head_dim: int, rot: int) -> None:
    """q and k are views into one fused qkv buffer (token stride > heads*dim), as the attention layer has them.
    72/36 has no whole 16-byte vectors of pairs in f16/bf16: the scalar kernel; the others the vectorised one."""
    tokens, hq, hk, max_pos = 13, 6, 2, 5000
    g = _gen(head_dim + rot)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g, device=DEV).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    v_before = qkv[:, (hq + hk) * head_dim :].clone()
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float64) / rot))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    table = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(DEV)
    pos = torch.randint(0, max_pos, (tokens,), generator=g, device=DEV)
    want_q, want_k = _rope_reference(q, pos, table, neox), _rope_reference(k, pos, table, neox)
    cuda_rotary.rotary_embedding_(q, k, pos, table, neox)
    assert rel_error(q, want_q) < REL_TOL[dtype]
    assert rel_error(k, want_k) < REL_TOL[dtype]
    assert torch.equal(qkv[:, (hq + hk) * head_dim :], v_before), "rotary wrote outside q and k"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("neox", [True, False])
@pytest.mark.parametrize("head_dim,hq,hk", [(128, 32, 8), (64, 7, 1), (256, 4, 4)])
def test_rotary_with_cache_write(dtype: torch.dtype, neox: bool, head_dim: int, hq: int, hk: int) -> None:
    """The fused launch: q/k rotated in place as the plain kernel does, rotated k and v stored at their slots
    of the paged cache, slot -1 rows skipped, every other cache slot untouched."""
    tokens, block_size, blocks, max_pos = 11, 16, 9, 3000
    g = _gen(head_dim * hq + hk)
    qkv = torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g, device=DEV).to(dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hk) * head_dim].view(tokens, hk, head_dim)
    v = qkv[:, (hq + hk) * head_dim :].view(tokens, hk, head_dim)
    inv = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv)
    table = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(DEV)
    pos = torch.randint(0, max_pos, (tokens,), generator=g, device=DEV)
    slots = torch.randperm(blocks * block_size, generator=g, device=DEV)[:tokens]
    slots[4] = -1
    cache = torch.randn(2, blocks, block_size, hk, head_dim, generator=g, device=DEV).to(dtype)
    want_q, want_k = _rope_reference(q, pos, table, neox), _rope_reference(k, pos, table, neox)
    want_cache = cache.clone().view(2, -1, hk, head_dim)
    keep = slots >= 0
    want_cache[0, slots[keep]] = want_k[keep].to(dtype)
    want_cache[1, slots[keep]] = v[keep]
    assert cuda_rotary.rotary_cache_supported(q, k, v, pos, table, cache, slots)
    cuda_rotary.rotary_embedding_cache_(q, k, v, pos, table, neox, cache, slots)
    assert rel_error(q, want_q) < REL_TOL[dtype]
    assert rel_error(k, want_k) < REL_TOL[dtype]
    flat = cache.view(2, -1, hk, head_dim)
    assert torch.equal(flat[0, slots[keep]], k[keep]), "the cached k differs from the rotated k"
    assert rel_error(flat[0, slots[keep]], want_k[keep]) < REL_TOL[dtype]
    assert torch.equal(flat[1], want_cache[1])
    others = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    others[slots[keep]] = False
    assert torch.equal(flat[0, others], want_cache[0, others])


def test_rotary_with_cache_refuses_partial_rotary() -> None:
    q, k, v = (torch.randn(3, 2, 64, device=DEV).to(torch.bfloat16) for _ in range(3))
    table = torch.randn(100, 32, device=DEV)
    cache = torch.zeros(2, 4, 16, 2, 64, device=DEV, dtype=torch.bfloat16)
    slots = torch.arange(3, device=DEV)
    pos = torch.arange(3, device=DEV)
    assert not cuda_rotary.rotary_cache_supported(q, k, v, pos, table, cache, slots)
    with pytest.raises(ValueError, match="unsupported"):
        cuda_rotary.rotary_embedding_cache_(q, k, v, pos, table, True, cache, slots)
