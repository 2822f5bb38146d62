"""Paged decode attention and the KV-cache write against float64 attention over gathered K/V."""

from __future__ import annotations

import math

import pytest
import torch
from _cuda_helpers import REL_TOL, poison_allocator, rel_error
from paged_cases import DEV, paged_case, reference

from candle_vllm.pyengine.ops import cuda_paged
from candle_vllm.pyengine.ops.rotary import apply_rotary_and_cache, rope_cos_sin_cache

pytestmark = pytest.mark.cuda



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(8, 8), (16, 8), (32, 8), (28, 4), (16, 1)])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_paged_decode_matches_reference(dtype: torch.dtype, d: int, hq: int, hk: int, block_size: int) -> None:
    """Every head geometry the kernel specialises (GQA groups 1, 2, 4, 7 and 16 = two CTAs per kv head)."""
    seq_lens = [1, 17, 300, 1025]
    q, cache, table_t, tables = paged_case(seq_lens, hq, hk, d, block_size, dtype, seed=d + hq + block_size)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    scale = d**-0.5
    poison_allocator(DEV, 1 << 22)
    got = cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, scale, max_seq_len=max(seq_lens))
    assert rel_error(got, reference(q, cache, tables, seq_lens, scale)) < REL_TOL[dtype]


@pytest.mark.parametrize("partition_size", [64, 128, 512])
@pytest.mark.parametrize("max_seq_len", [None, 4096])
def test_split_kv_partitions_and_graph_sized_grid(partition_size: int, max_seq_len: int | None) -> None:
    """Split-KV pieces and a grid sized for a longer maximum (as a captured CUDA graph has) give one answer."""
    seq_lens = [5, 64, 65, 700, 2000]
    q, cache, table_t, tables = paged_case(seq_lens, 32, 8, 128, 32, torch.bfloat16, seed=partition_size)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    got = cuda_paged.paged_decode_attention(
        q, cache, table_t, lens_t, 0.1, max_seq_len=max_seq_len or max(seq_lens), partition_size=partition_size
    )
    assert rel_error(got, reference(q, cache, tables, seq_lens, 0.1)) < REL_TOL[torch.bfloat16]


def test_block_size_not_a_power_of_two() -> None:
    """Block sizes outside the shift path (here 48) take the division path and give the same answer."""
    seq_lens = [7, 48, 49, 1000]
    q, cache, table_t, tables = paged_case(seq_lens, 32, 8, 128, 48, torch.bfloat16, seed=48)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    got = cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, 0.1, max_seq_len=1024, partition_size=128)
    assert rel_error(got, reference(q, cache, tables, seq_lens, 0.1)) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("partition_size", [64, 1024])
def test_sliding_window_and_softcap(partition_size: int) -> None:
    """Window and cap with split-KV (pieces wholly before the window are empty) and with one piece."""
    seq_lens = [3, 200, 900]
    q, cache, table_t, tables = paged_case(seq_lens, 16, 4, 128, 16, torch.float16, seed=7)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    got = cuda_paged.paged_decode_attention(
        q, cache, table_t, lens_t, 0.08, max_seq_len=1024, sliding_window=100, softcap=30.0, partition_size=partition_size
    )
    want = reference(q, cache, tables, seq_lens, 0.08, window=100, softcap=30.0)
    assert rel_error(got, want) < REL_TOL[torch.float16]


@pytest.mark.parametrize("d", [64, 128, 256])
def test_kv_heads_not_a_multiple_of_the_cta_heads(d: int) -> None:
    """12 kv heads: a CTA covers 1024 / d of them, so the last CTA of each sequence has idle warps and copies."""
    seq_lens = [9, 130, 777]
    q, cache, table_t, tables = paged_case(seq_lens, 24, 12, d, 32, torch.bfloat16, seed=d)
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    poison_allocator(DEV, 1 << 22)
    got = cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, d**-0.5, max_seq_len=1024, partition_size=64)
    assert rel_error(got, reference(q, cache, tables, seq_lens, d**-0.5)) < REL_TOL[torch.bfloat16]


def test_graph_replay_with_other_lengths_and_automatic_split() -> None:
    """One CUDA graph captured for a 24k grid (automatic piece count), replayed over shorter and longer contexts
    than at capture: the kernel re-cuts each sequence's span into the captured pieces, and the reduce (a
    programmatic dependent launch) stays ordered after it inside the graph."""
    max_len = 24576
    q, cache, table_t, tables = paged_case([max_len, 3000], 32, 8, 128, 64, torch.bfloat16, seed=11)
    lens_t = torch.tensor([5, 5], dtype=torch.int32, device=DEV)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, 0.09, max_seq_len=max_len)  # warm-up outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, 0.09, max_seq_len=max_len)
    for lens in ([5, 5], [max_len, 3000], [1, 2999], [17000, 64]):
        lens_t.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(out, reference(q, cache, tables, lens, 0.09)) < REL_TOL[torch.bfloat16], lens


def test_partition_rule_covers_the_grid() -> None:
    """The automatic piece length is whole stages (16-token tiles, one per warp of a kv head) and, times the piece
    count, covers max_seq_len; heads per CTA x warps per head are a valid launch setting whose K/V stages fit
    the device's shared memory."""
    for b, hk, d, max_len in [(1, 8, 128, 4096), (1, 8, 128, 32768), (64, 8, 128, 1024), (7, 2, 64, 100), (3, 16, 256, 9)]:
        q = torch.empty(b, 4 * hk, d, dtype=torch.bfloat16, device=DEV)
        cache = torch.empty(2, 1, 16, hk, d, dtype=torch.bfloat16, device=DEV)
        plan = cuda_paged.auto_decode_plan(q, cache, max_len)
        assert plan.partition_size % 16 == 0 and plan.partition_size > 0
        assert math.ceil(max_len / plan.partition_size) * plan.partition_size >= max_len
        assert 1 <= plan.heads_per_cta <= min(hk, 1024 // d)
        assert plan.splits >= 1 and plan.heads_per_cta * plan.splits <= 1024 // d
        assert plan.partition_size % (16 * plan.splits) == 0
        out = cuda_paged.paged_decode_attention(
            q.normal_(), cache.normal_(), torch.zeros(b, 1, dtype=torch.int32, device=DEV),
            torch.ones(b, dtype=torch.int32, device=DEV), 0.1, max_len,
        )
        assert torch.allclose(out.float(), cache[1, 0, 0].float().repeat_interleave(4, 0).expand_as(out), atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_slots_and_skips_padding(dtype: torch.dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(3)
    tokens, hk, d = 11, 4, 128
    cache = torch.randn(2, 9, 16, hk, d, generator=g, device=DEV).to(dtype)
    kv = torch.randn(tokens, 3 * hk * d, generator=g, device=DEV).to(dtype)  # fused qkv-like rows
    k = kv[:, hk * d : 2 * hk * d].view(tokens, hk, d)
    v = kv[:, 2 * hk * d :].view(tokens, hk, d)
    slots = torch.randperm(9 * 16, generator=g, device=DEV)[:tokens]
    slots[4] = -1
    want = cache.clone()
    flat = want.view(2, -1, hk, d)
    keep = slots >= 0
    flat[0][slots[keep]] = k[keep]
    flat[1][slots[keep]] = v[keep]
    cuda_paged.reshape_and_cache(k, v, cache, slots)
    assert torch.equal(cache, want)


# Contexts around tile (16) and piece (64) boundaries, odd lengths, one token.
_BOUNDARY_LENS = [1, 15, 16, 17, 63, 64, 65, 127, 129, 191, 192, 333, 1000]


@pytest.mark.parametrize("fused_reduce", [False, True])
@pytest.mark.parametrize("block_size", [16, 64])
@pytest.mark.parametrize("hq,hk", [(32, 8), (64, 8), (8, 8)])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("heads_per_cta", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_every_heads_per_cta_and_reduce_form(
    heads_per_cta: int, splits: int, d: int, hq: int, hk: int, block_size: int, fused_reduce: bool
) -> None:
    """Each CTA size (kv heads per CTA x warps per kv head up to 1024 / D warps), GQA 4:1, 8:1 and 1:1, both
    split-KV reduce forms, with contexts at tile, stage and piece boundaries (pieces of 64 tokens, or one stage
    of 16 * splits, for a 1024-token grid)."""
    if heads_per_cta * splits > 1024 // d:
        pytest.skip("more warps than one CTA holds at this head_dim")
    q, cache, table_t, tables = paged_case(_BOUNDARY_LENS, hq, hk, d, block_size, torch.bfloat16, seed=d + hq)
    lens_t = torch.tensor(_BOUNDARY_LENS, dtype=torch.int32, device=DEV)
    poison_allocator(DEV, 1 << 22)
    got = cuda_paged.paged_decode_attention(
        q, cache, table_t, lens_t, d**-0.5, max_seq_len=1024, partition_size=64, heads_per_cta=heads_per_cta,
        fused_reduce=fused_reduce, splits=splits,
    )
    assert rel_error(got, reference(q, cache, tables, _BOUNDARY_LENS, d**-0.5)) < REL_TOL[torch.bfloat16]


def test_fused_reduce_rearms_its_counters() -> None:
    """The last CTA re-zeroes its counter: the same fused call twice, then with other lengths, gives the right
    answer each time (a counter left non-zero would make no CTA, or the wrong one, reduce)."""
    seq_lens = [40, 250, 511]
    q, cache, table_t, tables = paged_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=5)
    for lens in (seq_lens, seq_lens, [33, 1, 300]):  # each within the blocks its sequence owns
        lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
        got = cuda_paged.paged_decode_attention(
            q, cache, table_t, lens_t, 0.1, max_seq_len=512, partition_size=128, heads_per_cta=2, fused_reduce=True
        )
        assert rel_error(got, reference(q, cache, tables, lens, 0.1)) < REL_TOL[torch.bfloat16], lens


def test_heads_per_cta_out_of_range_is_refused() -> None:
    q, cache, table_t, _ = paged_case([5], 8, 8, 256, 16, torch.bfloat16, seed=1)
    lens_t = torch.tensor([5], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match=r"heads_per_cta x splits must be 1 \.\. 4"):
        cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, 0.1, max_seq_len=16, heads_per_cta=8)
    with pytest.raises(ValueError, match=r"heads_per_cta x splits must be 1 \.\. 4"):
        cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, 0.1, max_seq_len=16, heads_per_cta=2, splits=4)
    with pytest.raises(ValueError, match=r"splits \(warps per kv head\) must be one of \(1, 2, 4\)"):
        cuda_paged.paged_decode_attention(q, cache, table_t, lens_t, 0.1, max_seq_len=16, heads_per_cta=1, splits=3)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("writer", ["rope_cache", "reshape_and_cache"])
@pytest.mark.parametrize(
    "heads_per_cta,fused_reduce,splits", [(8, False, 1), (2, False, 1), (2, True, 1), (1, True, 1), (1, False, 4), (2, True, 4)]
)
def test_decode_after_the_newest_token_write_in_a_graph(
    writer: str, heads_per_cta: int, fused_reduce: bool, splits: int, kv_dtype: torch.dtype
) -> None:
    """The decode step as the engine captures it: the fused RoPE + cache write (or reshape_and_cache) stores each
    sequence's newest K/V and rotates q, then the decode kernel, a programmatic dependent launch, runs right
    after it. Before each replay the newest slots hold large garbage and q is un-rotated, so a kernel that read
    q or the newest token's tile before its pdl_wait would attend to stale values and miss the reference."""
    hq, hk, d, bs = 32, 8, 128, 16
    lens = [1, 16, 17, 33, 64, 65, 129, 700]
    max_len = 1024
    _, cache, table_t, tables = paged_case(lens, hq, hk, d, bs, torch.bfloat16, seed=heads_per_cta,
                                            kv_dtype=kv_dtype)
    g = torch.Generator(device=DEV).manual_seed(17)
    b = len(lens)
    source = torch.randn(b, (hq + 2 * hk) * d, generator=g, device=DEV).to(torch.bfloat16)
    qkv = source.clone()
    q = qkv[:, : hq * d].view(b, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(b, hk, d)
    v = qkv[:, (hq + hk) * d :].view(b, hk, d)
    positions = torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=DEV)
    slots = torch.tensor([tables[i][(n - 1) // bs] * bs + (n - 1) % bs for i, n in enumerate(lens)], device=DEV)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos_sin = rope_cos_sin_cache(inv_freq, 1.0, max_len, DEV)
    lens_t = torch.tensor(lens, dtype=torch.int32, device=DEV)
    row_bytes = d * cache.element_size()
    flat = cache.view(torch.uint8).view(2, -1, hk, row_bytes)  # bytes: torch has no index_put_ for float8

    def step() -> torch.Tensor:
        qkv.copy_(source)
        if writer == "rope_cache":
            assert apply_rotary_and_cache(q, k, v, positions, cos_sin, True, cache, slots)
        else:
            cuda_paged.reshape_and_cache(k, v, cache, slots)
        return cuda_paged.paged_decode_attention(
            q, cache, table_t, lens_t, d**-0.5, max_len, partition_size=64, heads_per_cta=heads_per_cta,
            fused_reduce=fused_reduce, splits=splits,
        )

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for trial in range(3):
        flat[:, slots] = (40.0 * torch.randn(2, b, hk, d, generator=g, device=DEV)).to(kv_dtype).view(torch.uint8)
        stale = flat[:, slots].clone()
        graph.replay()
        torch.cuda.synchronize()
        written = flat[:, slots]
        assert not torch.equal(written, stale), "the writer kernel did not store the newest K/V"
        want = reference(q, cache, tables, lens, d**-0.5)  # q rotated in place, cache holding the new rows
        assert rel_error(out, want) < REL_TOL[torch.bfloat16], trial
