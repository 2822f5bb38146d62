"""The kernels that apply a deferred RMSNorm (``ops.norm.DeferredRMSNorm``): the RoPE + cache write and the
interleaved SiLU, with each token's 1/rms of its residual row, against float64 references on random data."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from _cuda_helpers import REL_TOL, rel_error

from candle_vllm.pyengine.ops import cuda, cuda_rotary, cuda_wide
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.row_pairs import deinterleave_halves

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
HALF = [torch.float16, torch.bfloat16]
EPS = 1e-5



def _rows(tokens: int, hidden: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Residual rows as a view with a token stride past hidden, of a few units' scale (as a residual stream)."""
    return (torch.randn(tokens, hidden + 64, generator=g, device=DEV) * 3).to(dtype)[:, :hidden]


def _inv_rms(rows: torch.Tensor) -> torch.Tensor:
    x = rows.double()
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def _rope64(x: torch.Tensor, pos: torch.Tensor, table: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 neox rotation of whole heads x [T, H, D] (cos/sin rounded to the activations' dtype first)."""
    cos, sin = table[pos].to(dtype).double().unsqueeze(1).chunk(2, dim=-1)
    x = x.double()
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("pair_group", [0, 8])
@pytest.mark.parametrize(
    "tokens,hq,hk,d,hidden",
    # 40 / 384 / 192 / 224 threads per token (224: warps and CTAs spanning two tokens); 2056 = 257 vectors, a
    # row past a whole number of load rounds
    [(37, 6, 2, 64, 576), (20, 32, 8, 128, 4096), (1, 4, 4, 256, 1024), (17, 20, 4, 128, 2056)],
)
def test_rotary_cache_applies_the_deferred_norm(
    dtype: torch.dtype, pair_group: int, tokens: int, hq: int, hk: int, d: int, hidden: int
) -> None:
    """q and k scaled then rotated in place, v scaled in place, k and v stored at their slots (slot -1 skipped,
    its v still scaled); the heads may come in the paired layout."""
    g = torch.Generator(device=DEV).manual_seed(tokens * d + pair_group)
    block_size, blocks, max_pos = 16, 8, 4000
    qkv = torch.randn(tokens, (hq + 2 * hk) * d, generator=g, device=DEV).to(dtype)
    q = qkv[:, : hq * d].view(tokens, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(tokens, hk, d)
    v = qkv[:, (hq + hk) * d :].view(tokens, hk, d)
    std = (lambda t: deinterleave_halves(t, d, pair_group)) if pair_group else (lambda t: t)
    q_std, k_std, v_in = std(q).clone(), std(k).clone(), v.clone()
    rows = _rows(tokens, hidden, dtype, g)
    inv = _inv_rms(rows).view(tokens, 1, 1)
    inv_freq = 1.0 / (500000 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float64), inv_freq)
    table = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(DEV)
    pos = torch.randint(0, max_pos, (tokens,), generator=g, device=DEV)
    slots = torch.randperm(blocks * block_size, generator=g, device=DEV)[:tokens]
    slots[tokens // 2] = -1
    cache = torch.randn(2, blocks, block_size, hk, d, generator=g, device=DEV).to(dtype)
    before = cache.clone()
    want_q, want_k = _rope64(q_std.double() * inv, pos, table, dtype), _rope64(k_std.double() * inv, pos, table, dtype)
    want_v = v_in.double() * inv
    norm = DeferredRMSNorm(rows, EPS)
    assert cuda_rotary.rotary_cache_supported(q, k, v, pos, table, cache, slots, pair_group, norm)
    cuda_rotary.rotary_embedding_cache_(q, k, v, pos, table, True, cache, slots, pair_group, norm)
    assert rel_error(q, want_q) < REL_TOL[dtype]
    assert rel_error(k, want_k) < REL_TOL[dtype]
    assert rel_error(v, want_v) < REL_TOL[dtype]
    flat, old = cache.view(2, -1, hk, d), before.view(2, -1, hk, d)
    keep = slots >= 0
    assert torch.equal(flat[0, slots[keep]], k[keep]) and torch.equal(flat[1, slots[keep]], v[keep])
    others = torch.ones(flat.shape[1], dtype=torch.bool, device=DEV)
    others[slots[keep]] = False
    assert torch.equal(flat[:, others], old[:, others])


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("tokens,d,hidden", [(1, 128, 64), (37, 1000, 576), (64, 14336, 4096)])
def test_silu_interleaved_applies_the_deferred_norm(dtype: torch.dtype, tokens: int, d: int, hidden: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(tokens + d)
    x = torch.randn(tokens, 2 * d, generator=g, device=DEV).to(dtype)
    rows = _rows(tokens, hidden, dtype, g)
    pairs = x.double().view(tokens, d // 8, 2, 8)
    gate, up = pairs[:, :, 0].reshape(tokens, d), pairs[:, :, 1].reshape(tokens, d)
    inv = _inv_rms(rows)
    want = F.silu(gate * inv) * (up * inv)
    got = cuda.silu_and_mul_interleaved(x, DeferredRMSNorm(rows, EPS))
    assert got is not None and got.shape == (tokens, d)
    assert rel_error(got, want) < REL_TOL[dtype]


def _graph_after_gemm(
    rows: torch.Tensor,
    staging: torch.Tensor,
    gemm: Callable[[torch.Tensor], torch.Tensor],
    consume: Callable[[torch.Tensor], torch.Tensor | None],
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The model's chain captured in a CUDA graph: a kernel writes the residual rows, the GEMM reads them, the
    consumer takes the GEMM's output and the rows' deferred norm. Returns (graph, what the consumer wrote)."""
    rows.copy_(staging)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # cuBLAS's handle and workspace, and the kernels' first launches, outside capture
        consume(gemm(rows))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rows.copy_(staging)
        out = consume(gemm(rows))
    assert out is not None
    return graph, out


def _gemm(kind: str, rows: torch.Tensor, w: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x @ w.T by cuBLAS (torch) or by our wide GEMM (skipped where it cannot run: it needs an sm_90a build)."""
    if kind == "cublas":
        return lambda x: F.linear(x, w)
    if not cuda_wide.wide_gemm_supported(rows, w):
        pytest.skip("the wide GEMM needs a Hopper GPU and an sm_90a build")
    return lambda x: cuda_wide.wide_gemm(x, w)


@pytest.mark.parametrize("gemm", ["cublas", "wide"])
@pytest.mark.parametrize("consumer", ["silu", "rope"])
def test_norm_before_the_wait_in_the_models_graph_chain(consumer: str, gemm: str) -> None:
    """The consumers compute the rows' 1/rms before their PDL wait, while the GEMM before them runs
    (deferred_norm.h), here in the model's chain in a CUDA graph after cuBLAS or our wide GEMM (which may trigger
    them only once its every thread has waited for the rows' writer). Replayed with new rows each time, each of its
    own scale, every replay must take its own rows' scale (the previous replay's would be 25 % or more off). The
    rows' writer and the GEMM are joined by a full edge here, as in the model, so this checks the early read in
    that chain; it cannot provoke a read of unfinished rows (deferred_norm.h says why none can happen)."""
    dtype, tokens, hidden = torch.bfloat16, 64, 4096
    g = torch.Generator(device=DEV).manual_seed(7)
    sources = [torch.randn(tokens, hidden, generator=g, device=DEV).mul(2 * i + 2).to(dtype) for i in range(4)]
    rows, staging = torch.empty_like(sources[0]), sources[0].clone()
    norm = DeferredRMSNorm(rows, EPS)
    if consumer == "silu":  # a 117 MB gate/up weight: the SiLU's grid launches while the GEMM streams it
        d = 7168
        w = (torch.randn(2 * d, hidden, generator=g, device=DEV) / hidden**0.5).to(dtype)
        run = _gemm(gemm, rows, w)
        graph, got = _graph_after_gemm(rows, staging, run, lambda y: cuda.silu_and_mul_interleaved(y, norm))

        def want(src: torch.Tensor) -> torch.Tensor:
            pairs = F.linear(src, w).double().view(tokens, d // 8, 2, 8)
            inv = _inv_rms(src)
            return F.silu(pairs[:, :, 0].reshape(tokens, d) * inv) * (pairs[:, :, 1].reshape(tokens, d) * inv)
    else:  # Llama-3-8B's qkv: 32 q and 8 kv heads of 128
        hq, hk, hd, block_size = 32, 8, 128, 16
        w = (torch.randn((hq + 2 * hk) * hd, hidden, generator=g, device=DEV) / hidden**0.5).to(dtype)
        inv_freq = 1.0 / (500000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        freqs = torch.outer(torch.arange(4096, dtype=torch.float64), inv_freq)
        table = torch.cat([freqs.cos(), freqs.sin()], -1).float().to(DEV)
        pos = torch.randint(0, 4096, (tokens,), generator=g, device=DEV)
        blocks = 64
        slots = torch.randperm(blocks * block_size, generator=g, device=DEV)[:tokens]
        cache = torch.zeros(2, blocks, block_size, hk, hd, dtype=dtype, device=DEV)
        run = _gemm(gemm, rows, w)

        def rope(y: torch.Tensor) -> torch.Tensor:  # q and k rotated, v scaled, in y
            q, k, v = y[:, : hq * hd], y[:, hq * hd : (hq + hk) * hd], y[:, (hq + hk) * hd :]
            cuda_rotary.rotary_embedding_cache_(q.view(tokens, hq, hd), k.view(tokens, hk, hd),
                                                v.view(tokens, hk, hd), pos, table, True, cache, slots, 0, norm)
            return y

        graph, got = _graph_after_gemm(rows, staging, run, rope)

        def want(src: torch.Tensor) -> torch.Tensor:
            raw = F.linear(src, w).double()
            inv = _inv_rms(src).view(tokens, 1, 1)
            q = raw[:, : hq * hd].view(tokens, hq, hd) * inv
            k = raw[:, hq * hd : (hq + hk) * hd].view(tokens, hk, hd) * inv
            v = raw[:, (hq + hk) * hd :].view(tokens, hk, hd) * inv
            return torch.cat([_rope64(q, pos, table, dtype), _rope64(k, pos, table, dtype), v], 1).view(tokens, -1)
    for src in sources[1:] + sources[:1]:
        staging.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(got, want(src)) < REL_TOL[dtype]


def test_rows_the_kernels_cannot_read_are_refused() -> None:
    """Rows of a hidden size off whole 16-byte vectors, or of another dtype: the kernels are not asked (the callers
    then scale in torch)."""
    tokens, d = 5, 64
    q, k, v = (torch.randn(tokens, 2, d, device=DEV).to(torch.bfloat16) for _ in range(3))
    table = torch.randn(100, d, device=DEV)
    cache = torch.zeros(2, 4, 16, 2, d, device=DEV, dtype=torch.bfloat16)
    slots, pos = torch.arange(tokens, device=DEV), torch.arange(tokens, device=DEV)
    bad = DeferredRMSNorm(torch.randn(tokens, 100, device=DEV).to(torch.bfloat16), EPS)
    other_dtype = DeferredRMSNorm(torch.randn(tokens, 64, device=DEV).to(torch.float16), EPS)
    for norm in (bad, other_dtype):
        assert not cuda_rotary.rotary_cache_supported(q, k, v, pos, table, cache, slots, 0, norm)
        assert cuda.silu_and_mul_interleaved(torch.randn(tokens, 32, device=DEV).to(torch.bfloat16), norm) is None
    assert cuda_rotary.rotary_cache_supported(q, k, v, pos, table, cache, slots, 0, None)
