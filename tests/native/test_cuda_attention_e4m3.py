"""The e4m3 KV cache (--kvcache-dtype fp8) on CUDA: the cache writes against torch's float8 cast, and the paged
decode kernel against float64 attention over the values the cache holds."""

from __future__ import annotations

import pytest
import torch
from _cuda_helpers import REL_TOL, poison_allocator, rel_error
from paged_cases import DEV, e4m3, paged_case, reference

from candle_vllm.pyengine.ops import cuda_paged
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention
from candle_vllm.pyengine.ops.rotary import apply_rotary_and_cache, rope_cos_sin_cache

pytestmark = pytest.mark.cuda
E4M3 = torch.float8_e4m3fn


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(8, 8), (32, 8), (28, 4), (16, 1), (12, 3)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_reads_the_e4m3_values(dtype: torch.dtype, d: int, hq: int, hk: int, block_size: int) -> None:
    """Every head geometry (3 kv heads at D = 64 make a stage row of 12 chunks, padded to 16), q in bf16 and f16:
    the kernel's f16 mma over converted fragments against float64 attention over the cached values."""
    lens = [1, 17, 300, 1025]
    q, cache, table_t, tables = paged_case(lens, hq, hk, d, block_size, dtype, seed=d + hq, kv_dtype=E4M3)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    poison_allocator(DEV, 1 << 22)
    got = cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, d**-0.5, max_seq_len=max(lens))
    assert rel_error(got, reference(q, cache, tables, lens, d**-0.5)) < REL_TOL[dtype]


@pytest.mark.parametrize("fused_reduce", [False, True])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads_per_cta", [1, 2, 3, 8])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_every_cta_shape_with_an_e4m3_cache(heads_per_cta: int, splits: int, d: int, fused_reduce: bool) -> None:
    """Each CTA size and both split-KV reduce forms (the pieces' outputs carry the interleaved channel order of
    the e4m3 P V tiles), a window and soft-cap on one case, contexts around tile and piece boundaries."""
    if heads_per_cta * splits > 1024 // d:
        pytest.skip("more warps than one CTA holds at this head_dim")
    lens = [1, 15, 16, 17, 64, 65, 191, 333, 1000]
    q, cache, table_t, tables = paged_case(lens, 32, 8, d, 16, torch.bfloat16, seed=d + splits, kv_dtype=E4M3)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    window, softcap = (100, 30.0) if heads_per_cta == 3 else (None, None)
    got = cuda_paged.paged_decode_attention(
        q, cache, table_t, lens_t, d**-0.5, max_seq_len=1024, partition_size=64, heads_per_cta=heads_per_cta,
        fused_reduce=fused_reduce, splits=splits, sliding_window=window, softcap=softcap,
    )
    want = reference(q, cache, tables, lens, d**-0.5, window=window, softcap=softcap)
    assert rel_error(got, want) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reshape_and_cache_stores_saturated_e4m3(dtype: torch.dtype) -> None:
    """Stored bytes equal torch's float8 cast of the clamped values, bit for bit (values past 448 included);
    padding slots stay untouched."""
    g = torch.Generator(device=DEV).manual_seed(4)
    tokens, hk, d = 13, 4, 128
    cache = e4m3(torch.randn(2, 9, 16, hk, d, generator=g, device=DEV))
    kv = (torch.randn(tokens, 3 * hk * d, generator=g, device=DEV) * 300).to(dtype)  # fused qkv-like rows
    k, v = kv[:, hk * d : 2 * hk * d].view(tokens, hk, d), kv[:, 2 * hk * d :].view(tokens, hk, d)
    slots = torch.randperm(9 * 16, generator=g, device=DEV)[:tokens]
    slots[5] = -1
    want = _bytes(cache).clone()
    keep = slots >= 0
    flat = want.view(2, -1, hk, d)
    flat[0][slots[keep]] = _bytes(e4m3(k[keep]))
    flat[1][slots[keep]] = _bytes(e4m3(v[keep]))
    cuda_paged.reshape_and_cache(k, v, cache, slots)
    assert (kv.float().abs() > 448).any()
    assert torch.equal(_bytes(cache), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_to_e4m3_gives_the_cached_values(dtype: torch.dtype) -> None:
    """k/v views of a fused qkv buffer rounded in place to torch's e4m3 cast (saturated) read back; q untouched."""
    g = torch.Generator(device=DEV).manual_seed(9)
    t, hq, hk, d = 37, 8, 2, 128
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g, device=DEV) * 200).to(dtype)
    before = qkv.clone()
    k, v = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d), qkv[:, (hq + hk) * d :].view(t, hk, d)
    cuda_paged.round_to_e4m3_(k, v)
    assert torch.equal(qkv[:, : hq * d], before[:, : hq * d])
    assert torch.equal(qkv[:, hq * d :], e4m3(before[:, hq * d :]).to(dtype))
    assert not torch.equal(qkv, before)


@pytest.mark.parametrize("pair_group", [0, 1, 8])
def test_rotary_cache_write_stores_the_rotated_k_as_e4m3(pair_group: int) -> None:
    """The fused RoPE + cache write into an e4m3 cache stores exactly the e4m3 cast of what it writes into a bf16
    cache, in every pair layout."""
    g = torch.Generator(device=DEV).manual_seed(6)
    tokens, hq, hk, d, max_len = 9, 16, 4, 128, 512
    source = (torch.randn(tokens, (hq + 2 * hk) * d, generator=g, device=DEV) * 20).to(torch.bfloat16)
    positions = torch.randint(0, max_len, (tokens,), generator=g, device=DEV)
    slots = torch.randperm(8 * 16, generator=g, device=DEV)[:tokens]
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos_sin = rope_cos_sin_cache(inv_freq, 1.0, max_len, DEV)
    caches = {}
    for kv_dtype in (torch.bfloat16, E4M3):
        qkv = source.clone()
        q, k, v = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hk) * d], qkv[:, (hq + hk) * d :]
        cache = torch.zeros(2, 8, 16, hk, d, device=DEV).to(kv_dtype)
        assert apply_rotary_and_cache(q, k.view(tokens, hk, d), v.view(tokens, hk, d), positions, cos_sin, True,
                                      cache, slots, pair_group=pair_group)
        caches[kv_dtype] = cache
    assert torch.equal(_bytes(caches[E4M3]), _bytes(e4m3(caches[torch.bfloat16])))


@pytest.mark.parametrize("route", ["auto", "native", "sdpa-flash", "reference"])
def test_every_attention_route_reads_the_e4m3_values(route: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of fresh prompts, a chunk after a cached prefix and decode rows through ``attention()`` with an e4m3
    cache: each route (the flash kernel, torch's kernels for fresh prompts, the torch reference on the GPU)
    attends to the values the cache holds, against float64 attention over them."""
    if route == "reference":
        monkeypatch.setenv("CANDLE_VLLM_OPS", "reference")
    else:
        monkeypatch.setenv("CANDLE_VLLM_PREFILL", route)
    g = torch.Generator(device=DEV).manual_seed(8)
    hq, hk, d, bs = 32, 8, 128, 16
    cached_new = [(0, 300), (0, 77), (40, 25), (90, 1), (17, 1)]
    num_blocks = sum((c + n + bs - 1) // bs for c, n in cached_new) + 2
    cache = e4m3(torch.randn(2, num_blocks, bs, hk, d, generator=g, device=DEV))
    perm = torch.randperm(num_blocks, generator=g, device=DEV).tolist()
    tables = [[perm.pop() for _ in range((c + n + bs - 1) // bs)] for c, n in cached_new]
    meta = AttentionMetadata.build([n for _, n in cached_new], [c + n for c, n in cached_new], DEV, tables, bs)
    t = sum(n for _, n in cached_new)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g, device=DEV) * 4).to(torch.bfloat16)
    q, k, v = (qkv[:, : hq * d].view(t, hq, d), qkv[:, hq * d : (hq + hk) * d].view(t, hk, d),
               qkv[:, (hq + hk) * d :].view(t, hk, d))
    got = attention(q, k, v, cache, meta, d**-0.5, hk)
    start = 0
    for s, (c, n) in enumerate(cached_new):
        for i in range(n):  # each query row as the last token of a context of c + i + 1
            row = got[start + i : start + i + 1]
            want = reference(q[start + i : start + i + 1], cache, [tables[s]], [c + i + 1], d**-0.5)
            assert rel_error(row, want) < REL_TOL[torch.bfloat16], (route, s, i)
        start += n
