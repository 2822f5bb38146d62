"""The engine's op dispatchers on CUDA (attention, rotary, SiLU-and-mul, unquantized linear) against the same
ops run as torch references on the CPU in float64: checks that the CUDA branches call the kernels correctly
(views into the fused qkv buffer, mixed prefill/decode batches, subsets of decode rows)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from _cuda_helpers import REL_TOL, poison_allocator, rel_error

from candle_vllm.pyengine.ops.activation import silu_and_mul
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention
from candle_vllm.pyengine.ops.rotary import (
    FUSED_CACHE_MAX_TOKENS,
    apply_rotary,
    apply_rotary_and_cache,
    rope_cos_sin_cache,
    rope_inv_freq,
)
from candle_vllm.pyengine.quant.unquantized import UnquantizedLinear

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
CPU = torch.device("cpu")



def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _qkv_views(t: int, hq: int, hk: int, d: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the model makes them: head views into one fused [T, (hq + 2 hk) * d] projection output."""
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=_gen(seed)).to(dtype).to(DEV)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    return q.reshape(t, hq, d), k.reshape(t, hk, d), v.reshape(t, hk, d)


def _run_both(
    query_lens: list[int], seq_lens: list[int], dtype: torch.dtype, window: int | None = None,
    softcap: float | None = None, hq: int = 8, hk: int = 2, d: int = 128, block_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CUDA output, float64 CPU reference output, CUDA cache after the call, reference cache after it)."""
    t = sum(query_lens)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=_gen(1)).tolist()
    tables, at = [], 0
    for n in blocks_per_seq:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(2, num_blocks, block_size, hk, d, generator=_gen(2)).to(dtype)
    q, k, v = _qkv_views(t, hq, hk, d, dtype, seed=3)
    scale = d**-0.5
    cache_gpu = cache.to(DEV)
    meta = AttentionMetadata.build(query_lens, seq_lens, DEV, tables, block_size)
    got = attention(q, k, v, cache_gpu, meta, scale, hk, window, softcap)
    cache_ref = cache.double()
    meta_ref = AttentionMetadata.build(query_lens, seq_lens, CPU, tables, block_size)
    want = attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), cache_ref, meta_ref, scale, hk, window,
                     softcap)
    return got, want, cache_gpu, cache_ref


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_prefill_decode_batch(dtype: torch.dtype) -> None:
    # decode, prefill after a cached prefix, decode at a long context, fresh prefill (fused causal SDPA)
    got, want, cache, cache_ref = _run_both([1, 5, 1, 9], [37, 20, 700, 9], dtype)
    assert rel_error(got, want) < REL_TOL[dtype]
    assert rel_error(cache, cache_ref) < REL_TOL[dtype]


@pytest.mark.parametrize("window,softcap", [(None, None), (50, None), (None, 20.0)])
def test_pure_decode_step(window: int | None, softcap: float | None) -> None:
    got, want, cache, cache_ref = _run_both([1] * 6, [1, 16, 17, 300, 1025, 64], torch.bfloat16, window, softcap)
    assert rel_error(got, want) < REL_TOL[torch.bfloat16]
    assert rel_error(cache, cache_ref) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_in_place_on_qkv_views(neox: bool) -> None:
    q, k, _ = _qkv_views(11, 8, 2, 64, torch.bfloat16, seed=4)
    positions = torch.randint(0, 4000, (11,), generator=_gen(5))
    inv, factor = rope_inv_freq(64, 500000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    table = rope_cos_sin_cache(inv, factor, 4096)
    want_q, want_k = apply_rotary(q.cpu().double(), k.cpu().double(), positions, table.double(), neox)
    got_q, got_k = apply_rotary(q, k, positions.to(DEV), table.to(DEV), neox)
    assert rel_error(got_q, want_q) < REL_TOL[torch.bfloat16]
    assert rel_error(got_k, want_k) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("query_lens,seq_lens", [([1, 5, 1, 9], [37, 20, 700, 9]), ([1] * 5, [1, 16, 17, 300, 64])])
def test_fused_rotary_cache_then_attention(query_lens: list[int], seq_lens: list[int]) -> None:
    """The model's CUDA path: RoPE + cache write in one launch, then attention told the cache is written, against
    the float64 CPU path (RoPE, then attention writing the cache itself): outputs and whole caches agree."""
    hq, hk, d, bs, t = 8, 2, 128, 16, sum(query_lens)
    num_blocks = sum((s + bs - 1) // bs for s in seq_lens) + 2
    perm = torch.randperm(num_blocks, generator=_gen(11)).tolist()
    tables, at = [], 0
    for s in seq_lens:
        tables.append(perm[at : at + (s + bs - 1) // bs])
        at += (s + bs - 1) // bs
    cache = torch.randn(2, num_blocks, bs, hk, d, generator=_gen(12)).to(torch.bfloat16)
    q, k, v = _qkv_views(t, hq, hk, d, torch.bfloat16, seed=13)
    positions = torch.cat([torch.arange(s - n, s) for n, s in zip(query_lens, seq_lens, strict=True)])
    table = rope_cos_sin_cache(*rope_inv_freq(d, 500000.0), 1024)
    want_cache = cache.double()
    meta = AttentionMetadata.build(query_lens, seq_lens, CPU, tables, bs)
    rq, rk = apply_rotary(q.cpu().double(), k.cpu().double(), positions, table.double(), True)
    want = attention(rq, rk, v.cpu().double(), want_cache, meta, d**-0.5, hk)
    got_cache = cache.to(DEV)
    meta = AttentionMetadata.build(query_lens, seq_lens, DEV, tables, bs)
    assert meta.slot_mapping is not None
    assert apply_rotary_and_cache(q, k, v, positions.to(DEV), table.to(DEV), True, got_cache, meta.slot_mapping)
    got = attention(q, k, v, got_cache, meta, d**-0.5, hk, kv_cached=True)
    assert rel_error(got, want) < REL_TOL[torch.bfloat16]
    assert rel_error(got_cache, want_cache) < REL_TOL[torch.bfloat16]


def test_fused_rotary_cache_left_to_long_prefills() -> None:
    """Above FUSED_CACHE_MAX_TOKENS the fused launch is slower: nothing is done and the caller is told so."""
    t = FUSED_CACHE_MAX_TOKENS + 1
    q, k, v = _qkv_views(t, 8, 2, 128, torch.bfloat16, seed=14)
    cache = torch.zeros(2, 40, 16, 2, 128, dtype=torch.bfloat16, device=DEV)
    q_before = q.clone()
    table = rope_cos_sin_cache(*rope_inv_freq(128, 10000.0), t, DEV)
    slots = torch.arange(t, device=DEV)
    assert not apply_rotary_and_cache(q, k, v, torch.arange(t, device=DEV), table, True, cache, slots)
    assert torch.equal(q, q_before) and not cache.any()


def test_silu_and_mul_dispatch() -> None:
    x = (torch.randn(7, 2 * 1000, generator=_gen(6)) * 3).to(torch.bfloat16)
    poison_allocator(DEV, 7 * 1000)
    got = silu_and_mul(x.to(DEV))
    xd = x.double()
    assert rel_error(got, F.silu(xd[:, :1000]) * xd[:, 1000:]) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("m", [1, 7, 16, 17, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unquantized_linear(m: int, dtype: torch.dtype) -> None:
    w = torch.randn(1000, 512, generator=_gen(m)).to(dtype) * 512**-0.5
    x = torch.randn(m, 512, generator=_gen(m + 1)).to(dtype)
    layer = UnquantizedLinear(w.to(DEV))
    poison_allocator(DEV, m * 1000)
    got = layer(x.to(DEV))
    assert got.dtype == dtype and got.shape == (m, 1000)
    # f32 through cuBLAS may use TF32: allow the bf16 bound there.
    tol = REL_TOL[torch.bfloat16] if dtype == torch.float32 else REL_TOL[dtype]
    assert rel_error(got, x.double() @ w.double().T) < tol
