"""Checked wrappers around the paged-attention CUDA kernels: the KV-cache write and the decode attention with
its launch plan (kv heads per CTA, split-KV pieces), which ``ops/attention.py`` dispatches to and the CUDA-graph
capture sizes for the longest context. Same contract as ``ops/cuda.py``: every precondition is checked here,
launches go on the caller's stream, allocations through torch (graph-capturable after one warm-up call, which
creates the reduce counters)."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import (
    HALF_DTYPES,
    _aligned,
    _cache_halves,
    _device_index,
    _heads_view_ok,
    available,
    cache_holds,
    sm_count,
)

_ATTN_TILE = 16  # tokens per K/V tile of the decode attention kernel (pieces are whole tiles)
_ATTN_STAGES = 3  # K/V tiles a decode CTA holds in shared memory
_ATTN_REGS = {64: 120, 128: 168, 256: 256}  # registers per decode thread (-Xptxas -v, sm_90a; allocated in 8s)
DECODE_SPLITS = (1, 2, 4)  # warps per kv head the decode kernel is compiled for
_ATTN_COUNTER_SLOTS = 1 << 16  # (sequence, head group) counters of the fused split-KV reduce



def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, Hk, D] into kv_cache [2, blocks, block_size, Hk, D] at flat slots [T] (int64; < 0 skips).
    An e4m3 cache stores each value saturated to +-448, rounded to nearest even."""
    ok = (
        available(k.device)
        and k.dtype == v.dtype
        and k.dtype in native.FLOAT_DTYPES
        and cache_holds(kv_cache, k.dtype)
        and _heads_view_ok(k)
        and _heads_view_ok(v)
        and kv_cache.is_contiguous()
        and kv_cache.dim() == 5
        and tuple(k.shape[1:]) == tuple(v.shape[1:]) == tuple(kv_cache.shape[3:])
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.numel() == k.shape[0] == v.shape[0]
    )
    if not ok:
        raise ValueError("reshape_and_cache: needs k/v [T, Hk, D] of the cache's dtype (or f16/bf16 for an e4m3 "
                         "cache) and int64 slots")
    kp, vp = _cache_halves(kv_cache)
    native.loaded().cuda_reshape_and_cache(
        k.data_ptr(), v.data_ptr(), kp, vp, slot_mapping.data_ptr(), k.shape[0], k.shape[1], k.shape[2],
        k.stride(0), v.stride(0), native.dtype_code(k), native.dtype_code(kv_cache), native.stream(k.device),
    )


def round_to_e4m3_(k: torch.Tensor, v: torch.Tensor) -> None:
    """Round k, v [T, Hk, D] (f16/bf16, heads packed, any token stride) in place to the values an e4m3 cache holds
    of them: torch's prefill kernels read k/v, not the cache, and must attend to the same values as every other
    route (one launch instead of torch's clamp / cast / cast-back per tensor)."""
    ok = (
        available(k.device)
        and k.dtype == v.dtype
        and k.dtype in HALF_DTYPES
        and _heads_view_ok(k)
        and _heads_view_ok(v)
        and k.shape == v.shape
    )
    if not ok:
        raise ValueError("round_to_e4m3_: needs f16/bf16 k/v [T, Hk, D] of one shape on a CUDA device")
    native.loaded().cuda_round_to_e4m3(
        k.data_ptr(), v.data_ptr(), k.shape[0], k.shape[1], k.shape[2], k.stride(0), v.stride(0),
        native.dtype_code(k), native.stream(k.device),
    )


def decode_max_heads_per_cta(kv_heads: int, head_dim: int) -> int:
    """Most kv heads one decode CTA covers: a warp each, ``cuda_attn_cta_row // head_dim`` at most."""
    return min(kv_heads, native.loaded().cuda_attn_cta_row // head_dim)


def decode_head_groups(kv_heads: int, head_dim: int, heads_per_cta: int | None = None) -> int:
    """CTAs per sequence and piece when a CTA covers ``heads_per_cta`` kv heads (default: the most it can)."""
    return math.ceil(kv_heads / (heads_per_cta or decode_max_heads_per_cta(kv_heads, head_dim)))


class DecodePlan(NamedTuple):
    """Launch shape of :func:`paged_decode_attention` for one batch bucket: kv heads per CTA, tokens per split-KV
    piece at the grid's maximum, and warps per kv head sharing its tiles."""

    heads_per_cta: int
    partition_size: int
    splits: int = 1


def decode_fused_reduce(parts: int) -> bool:
    """Whether the last CTA of each head group combines the split-KV pieces (instead of a second kernel)."""
    return 1 < parts <= _FUSED_REDUCE_MAX_PARTS


# Split-KV piece counts up to which the last CTA of a head group combines the pieces itself: it reads every
# piece's partial rows of its heads with few threads, cheap only for a few pieces (measure with
# ``bench_kernels.py --only attention``, "fused" column).
_FUSED_REDUCE_MAX_PARTS = 4
# Where the model picks whole-row CTAs (large batches, long single contexts), CTAs of whole / 4 kv heads with 2
# warps per head and half the pieces measured faster at kernel level (`bench_kernels.py --only attention`, H200,
# 2026-11-30, session 6 call 3; Llama-3-8B heads, us): batch 64 at 1k 66.1 -> 64.0, batch 16 at 4k 67.6 -> 64.4,
# batch 4 at 4k 21.6 -> 20.7, batch 1 at 32k 40.5 -> 37.5. More warps per head did not pay end to end at batch 1
# (4k, a CUDA graph with PDL: 4 warps 230 tok/s, 8 warps 210-213 vs 230 without): a CTA launched early holds its
# stages and registers while the GEMM before it runs.
_SPLIT_HEAD_DIVISOR = 4
# A smaller-CTA plan must beat the whole-row plan's modelled cost by this factor: the whole-row CTA streams each
# token's cache row as one contiguous run and is the measured best for batch 64 at 1k and batch 16 at 4k.
_SMALL_CTA_MARGIN = 0.9


def _piece_cost(ctas_per_piece: int, parts: int, max_tiles: int, share: float, resident: int, sms: int) -> float:
    """Modelled time of a decode grid in units of one full-row 16-token tile on one SM.

    Each SM streams its CTAs' tiles (``share``: a CTA's fraction of a full 1024-element row); a wave of resident
    CTAs pays one tile time of start-up (seq_lens -> block table -> first K/V); a lone small CTA has too few bytes
    in flight to reach the SM's share of bandwidth (half a full-row CTA's two stages suffice); each piece costs
    1/36 tile time for its partials and their one-pass reduce."""
    ctas = ctas_per_piece * parts
    per_sm = math.ceil(ctas / sms)
    waves = math.ceil(per_sm / resident)
    concurrent = min(per_sm, resident)
    speed = min(1.0, 2 * concurrent * share)
    tiles = math.ceil(max_tiles / parts)
    return waves * (tiles * concurrent * share / speed + 1) + parts / 36


@functools.lru_cache(maxsize=1024)
def decode_plan(
    num_seqs: int, kv_heads: int, head_dim: int, max_seq_len: int, sms: int, smem_per_sm: int, smem_per_cta: int,
    cache_bytes: int = 2,
) -> DecodePlan:
    """Heads per CTA and piece length for a grid serving contexts up to ``max_seq_len`` (``cache_bytes`` per
    cached value: 2 for a bf16/f16 cache, 1 for e4m3, whose stages take half the shared memory).

    Whole-row CTAs (the most heads) hold three 64 KB stages at D=128, so one runs per SM; at small batches fewer
    heads per CTA give more, smaller CTAs, several per SM. The cost model (:func:`_piece_cost`) was fitted to
    the H200 whole-row sweep of 2026-11-30 (32/8 heads, D=128): batch 1 at 4k, 64 pieces 12.5 us vs 128 pieces
    15.2 us vs 32 pieces 18.9 us; at 32k 128 pieces 43.5 us; batch 64 at 1k 2 pieces 72.9 us; batch 16 at 4k
    8 pieces 70.9 us. The per-piece term was halved with the one-pass reduce kernel (session-4 sweep, same
    machine and command: batch 1 at 4k in a 4096 grid 64 pieces 11.2 us vs the old pick of 43 pieces 12.8 us;
    at 32k 128 pieces 40.0 us vs 64 pieces 44.6 us; the other cases keep their plans). Fewer heads per CTA are
    taken only where the model gains ``_SMALL_CTA_MARGIN`` (they
    keep the whole-row plan at batch 64 / 1k and batch 16 / 4k), which then splits each kv head over two warps
    (``_SPLIT_HEAD_DIVISOR``). The kernel divides each sequence's actual span
    into the same number of pieces, so shorter contexts in a graph-sized grid keep every CTA busy.
    """
    row_heads = native.loaded().cuda_attn_cta_row // head_dim
    max_tiles = max(1, math.ceil(max_seq_len / _ATTN_TILE))
    warps_per_sm = 65536 // (32 * _ATTN_REGS[head_dim])
    best: dict[int, tuple[float, int]] = {}
    hmax = decode_max_heads_per_cta(kv_heads, head_dim)
    for heads in {hmax, *(h for h in (1, 2, 4, 8) if h < hmax)}:
        stages = _ATTN_STAGES * 2 * _ATTN_TILE * heads * head_dim * cache_bytes
        if stages >= smem_per_cta:
            continue
        resident = max(1, min(smem_per_sm // (stages + 1024), warps_per_sm // heads, 32))
        ctas = num_seqs * decode_head_groups(kv_heads, head_dim, heads)
        for parts in range(1, min(max_tiles, 4096) + 1):
            cost = _piece_cost(ctas, parts, max_tiles, heads / row_heads, resident, sms)
            if heads not in best or cost < best[heads][0]:
                best[heads] = (cost, parts)
    whole = max(best)
    smaller = [h for h in best if best[h][0] < _SMALL_CTA_MARGIN * best[whole][0]]
    heads = min(smaller, key=lambda h: (best[h][0], -h)) if smaller else whole
    parts = best[heads][1]
    splits = 1
    if heads == whole and whole >= _SPLIT_HEAD_DIVISOR:
        # Whole-row plans become quarter-row CTAs with 2 warps per kv head and half the pieces.
        heads, splits, parts = whole // _SPLIT_HEAD_DIVISOR, 2, math.ceil(parts / 2)
    unit = _ATTN_TILE * splits
    size = math.ceil(math.ceil(max_seq_len / parts) / unit) * unit
    return DecodePlan(heads, size, splits)


@functools.cache
def _smem_limits(device_index: int) -> tuple[int, int]:
    """Shared memory per SM and the most one CTA may opt in to (the SM's less the 1 KB it reserves per CTA, on
    sm_80/89/90)."""
    per_sm = torch.cuda.get_device_properties(device_index).shared_memory_per_multiprocessor
    return per_sm, per_sm - 1024


def auto_decode_plan(q: torch.Tensor, kv_cache: torch.Tensor, max_seq_len: int) -> DecodePlan:
    """:func:`decode_plan` for this q [B, Hq, D] / cache on its GPU."""
    dev = _device_index(q.device)
    return decode_plan(q.shape[0], kv_cache.shape[3], q.shape[2], max_seq_len, sm_count(dev), *_smem_limits(dev),
                       kv_cache.element_size())


@functools.cache
def _reduce_counters(device_index: int) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "paged_decode_attention: call it once before CUDA-graph capture (its reduce counters are created then)"
        )
    return torch.zeros(_ATTN_COUNTER_SLOTS, dtype=torch.int32, device=torch.device("cuda", device_index))


def paged_decode_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when :func:`paged_decode_attention` handles q [B, Hq, D] over this cache."""
    if not (available(q.device) and q.dtype in HALF_DTYPES and cache_holds(kv_cache, q.dtype) and kv_cache.dim() == 5):
        return False
    hk, d = kv_cache.shape[3], kv_cache.shape[4]
    return (
        _heads_view_ok(q)
        and q.shape[2] == d
        and d in (64, 128, 256)
        and q.shape[1] % hk == 0
        and q.shape[1] // hk <= 16
        and q.stride(0) % 8 == 0
        and kv_cache.is_contiguous()
        and _aligned(q, kv_cache)
    )


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    partition_size: int | None = None,
    heads_per_cta: int | None = None,
    fused_reduce: bool | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over the paged cache: q [B, Hq, D] -> out [B, Hq, D].

    ``max_seq_len`` (host int, >= every seq_lens entry) fixes the split-KV grid, so a CUDA graph captured with
    the model's maximum length serves every shorter context (the kernel cuts each sequence's actual span into
    that grid's pieces). ``partition_size``, ``heads_per_cta`` (kv heads per CTA), ``splits`` (warps per kv head in
    ``DECODE_SPLITS``, each taking every splits-th tile; heads x splits at most 1024 // D) and ``fused_reduce`` (the last CTA of a
    head group combines the pieces instead of a second kernel) override :func:`decode_plan` and
    :func:`decode_fused_reduce` one by one (benchmarks and tests use them). block_tables int32 [B, max_blocks],
    seq_lens int32 [B]. The first call on a device must not be inside CUDA-graph capture.
    """
    if not paged_decode_supported(q, kv_cache):
        raise ValueError(
            "paged_decode_attention needs f16/bf16 q [B, Hq, D] and cache [2, blocks, block_size, Hk, D] of q's "
            "dtype or e4m3, D in 64/128/256, Hq a multiple of Hk (at most 16x), 16-byte aligned"
        )
    if block_tables.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("paged_decode_attention: block_tables and seq_lens must be int32")
    block_tables, seq_lens = block_tables.contiguous(), seq_lens.contiguous()
    b, hq, d = q.shape
    _, _, block_size, hk, _ = kv_cache.shape
    plan = auto_decode_plan(q, kv_cache, max_seq_len)
    partition_size = partition_size or plan.partition_size
    heads_per_cta = heads_per_cta or plan.heads_per_cta
    splits = splits or plan.splits
    most = native.loaded().cuda_attn_cta_row // d
    if splits not in DECODE_SPLITS:
        raise ValueError(f"paged_decode_attention: splits (warps per kv head) must be one of {DECODE_SPLITS}")
    if not (heads_per_cta >= 1 and heads_per_cta * splits <= most):
        raise ValueError(f"paged_decode_attention: heads_per_cta x splits must be 1 .. {most} warps per CTA")
    parts = max(1, math.ceil(max_seq_len / partition_size))
    fused = decode_fused_reduce(parts) if fused_reduce is None else fused_reduce
    counters = _reduce_counters(_device_index(q.device))
    if b * decode_head_groups(hk, d, heads_per_cta) > counters.numel():
        raise ValueError("paged_decode_attention: more than 65536 (sequence, head group) pairs; use more heads per CTA")
    out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    po_ptr = pml_ptr = 0
    if parts > 1:
        partial_out = torch.empty(b, hq, parts, d, dtype=torch.float32, device=q.device)
        partial_ml = torch.empty(2, b, hq, parts, dtype=torch.float32, device=q.device)
        po_ptr, pml_ptr = partial_out.data_ptr(), partial_ml.data_ptr()
    kp, vp = _cache_halves(kv_cache)
    native.loaded().cuda_paged_attention_decode(
        out.data_ptr(), q.data_ptr(), kp, vp, block_tables.data_ptr(), seq_lens.data_ptr(), po_ptr, pml_ptr,
        counters.data_ptr() if fused else 0, b, hq, hk, d, q.stride(0), block_size, block_tables.shape[1],
        partition_size, parts, heads_per_cta, splits, scale, softcap or 0.0, sliding_window or 0, native.dtype_code(q),
        native.dtype_code(kv_cache), native.stream(q.device),
    )
    return out
