"""Checked wrappers around the TurboQuant cache kernels (``native/cuda/turbo_kv.cu``, ``turbo_decode.cu``,
``turbo_rope.cu``): the cache write (alone, or with the RoPE before it) and the paged decode attention over the rows
of ``kv_cache/turbo.py``, and the rows of listed blocks decoded into dense blocks for prefill steps
(``ops/attention_turbo.py`` dispatches to them). Same contract as ``ops/cuda.py``: preconditions checked here,
launches on the caller's stream, scratch through torch (so they run inside CUDA graphs)."""

from __future__ import annotations

import math
import os

import torch

from candle_vllm.pyengine.kv_cache import turbo
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import (
    HALF_DTYPES,
    _device_index,
    _heads_view_ok,
    available,
    deferred_norm_args,
    deferred_norm_ok,
    sm_count,
)
from candle_vllm.pyengine.ops.cuda_rotary import rope_style
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.row_pairs import PAIR_GROUPS

# A decode CTA (4 warps) takes a piece of a sequence's span, its length a multiple of this: two rounds of the
# CUDA-core kernel's warps (32 tokens each), four of the tensor-core kernel's (16 each). Shorter pieces measured
# slower at batch 1 (their queries' prologue and partials cost more than the parallelism gains).
PIECE_UNIT = 256
# Pieces per sequence: as many as fit one wave of this many CTAs per SM (the tensor-core kernel keeps 4 resident at
# D = 128), never more: a second, partial wave cost more than longer pieces (benches/RESULTS.md, session 42).
CTAS_PER_SM = 4
HEAD_DIMS = (64, 128, 256)
# The decode's tensor-core kernel where it takes the geometry (head_dim 64 / 128, block_size a multiple of 16);
# CANDLE_VLLM_TURBO_TENSOR_CORES=0 keeps every call on the CUDA-core kernel (an A/B switch for benches/).
TENSOR_CORES = os.environ.get("CANDLE_VLLM_TURBO_TENSOR_CORES", "1") != "0"


def turbo_supported(x: torch.Tensor, kv_cache: torch.Tensor, fmt: TurboFormat | None) -> bool:
    """Whether the kernels take this TurboQuant cache for activations like ``x`` (f16/bf16 on its CUDA device)."""
    return (
        fmt is not None
        and available(x.device)
        and x.dtype in HALF_DTYPES
        and fmt.head_dim in HEAD_DIMS
        and kv_cache.device == x.device
        and kv_cache.is_contiguous()
        and kv_cache.data_ptr() % 16 == 0
    )


def decode_supported(q: torch.Tensor, kv_cache: torch.Tensor, fmt: TurboFormat | None) -> bool:
    """Whether :func:`turbo_decode_attention` takes q [B, Hq, D] over this cache (Hq a multiple of its kv heads)."""
    return turbo_supported(q, kv_cache, fmt) and q.shape[1] % kv_cache.shape[3] == 0


def decode_pieces(num_seqs: int, q_heads: int, kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """How many pieces the decode cuts each sequence's span into: as many as one wave of CTAS_PER_SM CTAs per SM
    holds, at most one per PIECE_UNIT tokens of the longest context. Host-side, so a CUDA graph keeps the grid of
    its batch size."""
    ctas = num_seqs * kv_heads * math.ceil(q_heads // kv_heads / 8)
    fit = CTAS_PER_SM * sm_count(_device_index(device)) // max(1, ctas)
    return max(1, min(fit, math.ceil(max_seq_len / PIECE_UNIT), 65535))


def tensor_cores_take(fmt: TurboFormat, block_size: int) -> bool:
    """Whether the decode's tensor-core kernel takes this format and block size (else the CUDA-core kernel runs)."""
    return bool(native.loaded().cuda_turbo_tensor_cores_take(fmt.head_dim, fmt.k_bits, block_size))


def turbo_cache_write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      fmt: TurboFormat, round_trip: bool = False) -> None:
    """Store k, v [T, Hk, D] as rows of ``kv_cache`` at flat slots [T] (int64; < 0 skipped). ``round_trip`` then
    overwrites k and v with what their rows decode to (K turned back, as :func:`blocks_to_dense` gives it), so a
    dense attention over the step's own K/V sees the values later steps read from the cache."""
    ok = (
        turbo_supported(k, kv_cache, fmt)
        and k.dtype == v.dtype
        and _heads_view_ok(k)
        and _heads_view_ok(v)
        and k.shape == v.shape
        and k.shape[1:] == (kv_cache.shape[3], fmt.head_dim)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.numel() == k.shape[0]
    )
    if not ok:
        raise ValueError("turbo_cache_write: needs f16/bf16 k/v [T, Hk, D] on the cache's GPU, D 64/128/256, int64 "
                         "slots")
    native.loaded().cuda_turbo_cache_write(
        k.data_ptr(), v.data_ptr(), kv_cache.data_ptr(), slot_mapping.data_ptr(),
        turbo.channel_signs(fmt.head_dim, k.device).data_ptr(), k.shape[0], k.shape[1], fmt.head_dim,
        k.stride(0), v.stride(0), fmt.k_bits, round_trip, native.dtype_code(k), native.stream(k.device),
    )


def rope_cache_write_supported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: TurboFormat | None, pair_group: int = 0,
    norm: DeferredRMSNorm | None = None,
) -> bool:
    """Whether :func:`rope_cache_write_` takes these tensors: q [T, Hq, D], k/v [T, Hk, D] views with packed heads,
    whole-head rotary (cos_sin_cache [*, D] f32), the cache's kv heads and head size, int64 positions / slots."""
    return (
        turbo_supported(q, kv_cache, fmt)
        and fmt is not None
        and 0 < q.shape[0] <= 65535
        and all(t.dtype == q.dtype and t.device == q.device and _heads_view_ok(t) for t in (q, k, v))
        and k.shape == v.shape
        and tuple(k.shape[1:]) == (kv_cache.shape[3], fmt.head_dim) == (kv_cache.shape[3], q.shape[2])
        and k.shape[0] == q.shape[0]
        and cos_sin_cache.dtype == torch.float32 and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] == fmt.head_dim and cos_sin_cache.device == q.device
        and all(t.dtype == torch.int64 and t.is_contiguous() and t.numel() == q.shape[0] and t.device == q.device
                for t in (positions, slot_mapping))
        and pair_group in (0, *PAIR_GROUPS)
        and deferred_norm_ok(norm, q, q.shape[0])
    )


def rope_cache_write_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    is_neox: bool, kv_cache: torch.Tensor, slot_mapping: torch.Tensor, fmt: TurboFormat, pair_group: int = 0,
    norm: DeferredRMSNorm | None = None,
) -> None:
    """RoPE on q and k and the rows of k and v at ``slot_mapping`` in one launch (what ``rotary_embedding_cache_``
    is for dense caches): q comes out rotated, k and v as their rows decode to (k turned back), so the caller's
    attention can read the step's own K/V as the cache holds them. ``pair_group`` / ``norm`` as there."""
    if not rope_cache_write_supported(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, fmt, pair_group,
                                      norm):
        raise ValueError("rope_cache_write_: unsupported tensors (see rope_cache_write_supported)")
    native.loaded().cuda_turbo_rope_cache_write(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), cos_sin_cache.data_ptr(), kv_cache.data_ptr(),
        slot_mapping.data_ptr(), turbo.channel_signs(fmt.head_dim, q.device).data_ptr(), q.shape[0], q.shape[1],
        k.shape[1], fmt.head_dim, q.stride(0), k.stride(0), v.stride(0), rope_style(is_neox, pair_group), pair_group,
        fmt.k_bits, native.dtype_code(q), native.stream(q.device), *deferred_norm_args(norm),
    )


def turbo_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    fmt: TurboFormat,
    sliding_window: int | None = None,
    softcap: float | None = None,
    tensor_cores: bool = TENSOR_CORES,
    pieces: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its rows: q [B, Hq, D] (a view into a fused qkv buffer is read in place)
    -> out [B, Hq, D]. ``max_seq_len`` (host int, >= every seq_lens entry) caps the pieces; the grid follows only it
    and the batch, so a CUDA graph captured at the longest context serves all shorter ones. block_tables int32
    [B, max_blocks], seq_lens int32 [B]. ``tensor_cores=False`` forces the CUDA-core kernel; ``pieces`` overrides
    :func:`decode_pieces` (benches/bench_turbo_decode.py sweeps it)."""
    b, hq, d = q.shape
    hk = kv_cache.shape[3]
    if not _heads_view_ok(q):  # a view into a fused qkv buffer is read in place; other layouts are packed first
        q = q.contiguous()
    ok = (
        decode_supported(q, kv_cache, fmt)
        and d == fmt.head_dim
        and block_tables.dtype == seq_lens.dtype == torch.int32
        and block_tables.is_contiguous()
        and seq_lens.is_contiguous()
        and block_tables.shape[0] == seq_lens.shape[0] == b
    )
    if not ok:
        raise ValueError("turbo_decode_attention: needs f16/bf16 q [B, Hq, D] on the cache's GPU, Hq a multiple of the "
                         "cache's kv heads, int32 block_tables [B, max_blocks] and seq_lens [B]")
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if pieces is not None and not 1 <= pieces <= 65535:
        raise ValueError(f"turbo_decode_attention: pieces must be 1-65535, not {pieces}")
    parts = decode_pieces(b, hq, hk, max_seq_len, q.device) if pieces is None else pieces
    partials = torch.empty(b * hq * parts * (d + 2) if parts > 1 else 1, dtype=torch.float32, device=q.device)
    native.loaded().cuda_turbo_decode_attention(
        out.data_ptr(), q.data_ptr(), q.stride(0), kv_cache.data_ptr(), block_tables.data_ptr(), seq_lens.data_ptr(),
        turbo.channel_signs(d, q.device).data_ptr(), partials.data_ptr(), b, hq, hk, d, kv_cache.shape[2],
        block_tables.shape[1], parts, PIECE_UNIT, scale, sliding_window or 0, softcap or 0.0, fmt.k_bits, tensor_cores,
        native.dtype_code(q), native.stream(q.device),
    )
    return out


def blocks_to_dense(kv_cache: torch.Tensor, blocks: torch.Tensor, fmt: TurboFormat, out: torch.Tensor) -> None:
    """Decode the rows of cache blocks ``blocks`` (int64 [n]) into the dense cache ``out`` [2, n, block_size, Hk, D]
    (f16/bf16), K turned back from its rotation: what the flash prefill kernel reads with unrotated queries."""
    n, bs, hk = blocks.shape[0], kv_cache.shape[2], kv_cache.shape[3]
    ok = (
        turbo_supported(out, kv_cache, fmt)
        and kv_cache.dtype == torch.uint8
        and kv_cache.shape[-1] == fmt.row_bytes
        and blocks.dim() == 1
        and blocks.dtype == torch.int64
        and blocks.is_contiguous()
        and blocks.device == kv_cache.device
        and out.shape == (2, n, bs, hk, fmt.head_dim)
        and out.is_contiguous()
    )
    if not ok:
        raise ValueError("turbo_blocks_to_dense: needs a contiguous TurboQuant cache on a GPU, D 64/128/256, int64 "
                         "block ids [n] and a contiguous f16/bf16 out [2, n, block_size, Hk, D] on the cache's device")
    native.loaded().cuda_turbo_blocks_to_dense(
        out.data_ptr(), kv_cache.data_ptr(), blocks.data_ptr(),
        turbo.channel_signs(fmt.head_dim, out.device).data_ptr(), n, bs, hk, fmt.head_dim, fmt.k_bits,
        native.dtype_code(out), native.stream(out.device),
    )
