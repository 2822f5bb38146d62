"""Checked wrappers around the RoPE CUDA kernels (native/cuda/rotary.cu): in place on q and k, and with the K/V
cache store folded in; the heads may come in the paired layout of a q/k/v weight stored for a decode GEMM's RoPE
epilogue (``ops.row_pairs``: pair group 8 for the bf16 skinny GEMM, 1 for the GGUF GEMV)."""

from __future__ import annotations

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import (
    HALF_DTYPES,
    _aligned,
    _cache_halves,
    _heads_view_ok,
    available,
    cache_holds,
    deferred_norm_args,
    deferred_norm_ok,
)
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.row_pairs import PAIR_GROUPS


def rope_paired_head_dim_ok(head_dim: int) -> bool:
    """Whether heads of this size can be stored with interleaved halves (``ops.row_pairs``) and rotated in that
    layout: whole 16-row tiles, and head_dim / 16 lanes per head, a power of two within a warp."""
    groups = head_dim // 16
    return head_dim % 16 == 0 and 0 < groups <= 16 and groups & (groups - 1) == 0


def _paired_ok(q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor) -> bool:
    """The paired-layout kernel's extra needs: f16/bf16, whole-head rotary, 16-byte vectors everywhere."""
    d = q.shape[2]
    return (q.dtype in HALF_DTYPES and cos_sin_cache.shape[-1] == d and rope_paired_head_dim_ok(d)
            and q.stride(0) % 8 == 0 and k.stride(0) % 8 == 0 and _aligned(q, k, cos_sin_cache))


def rope_style(is_neox: bool, pair_group: int) -> int:
    """The kernels' RopeStyle code (native/cuda/rotary.h); a paired layout is neox by construction."""
    if pair_group and not is_neox:
        raise ValueError("RoPE: interleaved halves (pair_group) are a neox layout; gptj heads have none")
    return int(is_neox)


def rotary_supported(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, pair_group: int = 0
) -> bool:
    """True when :func:`rotary_embedding_` can rotate these tensors in place (``pair_group`` 1 or 8: heads stored
    with their halves interleaved in groups of that many channels, see :func:`rope_paired_head_dim_ok`)."""
    return (
        available(q.device)
        and q.dtype in native.FLOAT_DTYPES
        and k.dtype == q.dtype
        and _heads_view_ok(q)
        and _heads_view_ok(k)
        and q.shape[0] == k.shape[0] == positions.numel()
        and q.shape[2] == k.shape[2]
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] % 2 == 0
        and cos_sin_cache.shape[-1] <= q.shape[2]
        and all(t.device == q.device for t in (k, positions, cos_sin_cache))
        and (pair_group == 0 or (pair_group in PAIR_GROUPS and _paired_ok(q, k, cos_sin_cache)))
    )


def rotary_embedding_(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    pair_group: int = 0,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place (same maths as ``ops.rotary.apply_rotary``); heads stored
    with interleaved halves (neox, ``pair_group`` 1 or 8) are left in the standard layout."""
    if not rotary_supported(q, k, positions, cos_sin_cache, pair_group):
        raise ValueError("rotary_embedding_: unsupported tensors (see rotary_supported)")
    native.loaded().cuda_rotary_embedding(
        q.data_ptr(), k.data_ptr(), positions.data_ptr(), cos_sin_cache.data_ptr(), q.shape[0], q.shape[1],
        k.shape[1], q.shape[2], cos_sin_cache.shape[-1], q.stride(0), k.stride(0), rope_style(is_neox, pair_group),
        pair_group, native.dtype_code(q), native.stream(q.device),
    )


def rotary_cache_supported(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pair_group: int = 0,
    norm: DeferredRMSNorm | None = None,
) -> bool:
    """True when :func:`rotary_embedding_cache_` can rotate q/k and store k/v into ``kv_cache`` in one launch:
    whole heads rotate, k/v match the cache [2, blocks, block_size, Hk, D], and every row is made of 16-byte
    vectors (aligned pointers, token strides and D/2 in whole vectors), the norm's rows too."""
    if not rotary_supported(q, k, positions, cos_sin_cache, pair_group):
        return False
    vec = 16 // q.element_size()
    d = q.shape[2]
    return (
        v.dtype == q.dtype
        and cache_holds(kv_cache, q.dtype)
        and v.device == q.device
        and _heads_view_ok(v)
        and kv_cache.is_contiguous()
        and kv_cache.dim() == 5
        and tuple(k.shape[1:]) == tuple(v.shape[1:]) == tuple(kv_cache.shape[3:])
        and v.shape[0] == q.shape[0]
        and cos_sin_cache.shape[-1] == d
        and (d // 2) % vec == 0
        and all(t.stride(0) % vec == 0 for t in (q, k, v))
        and _aligned(q, k, v, cos_sin_cache, kv_cache)
        and slot_mapping.dtype == torch.int64
        and slot_mapping.is_contiguous()
        and slot_mapping.numel() == q.shape[0]
        and slot_mapping.device == q.device
        and deferred_norm_ok(norm, q, q.shape[0])
    )


def rotary_embedding_cache_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pair_group: int = 0,
    norm: DeferredRMSNorm | None = None,
) -> None:
    """:func:`rotary_embedding_` and :func:`reshape_and_cache` in one launch: q and k rotate in place, the rotated
    k and v are stored at ``slot_mapping`` (negative slots skipped). One launch fewer per layer and decode step.
    ``norm``: q, k and v are first scaled per token by it (v in place too), see :class:`DeferredRMSNorm`."""
    if not rotary_cache_supported(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, pair_group, norm):
        raise ValueError("rotary_embedding_cache_: unsupported tensors (see rotary_cache_supported)")
    kp, vp = _cache_halves(kv_cache)
    native.loaded().cuda_rotary_embedding_cache(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), positions.data_ptr(), cos_sin_cache.data_ptr(), kp, vp,
        slot_mapping.data_ptr(), q.shape[0], q.shape[1], k.shape[1], q.shape[2], q.stride(0), k.stride(0),
        v.stride(0), rope_style(is_neox, pair_group), pair_group, native.dtype_code(q), native.dtype_code(kv_cache),
        native.stream(q.device), *deferred_norm_args(norm),
    )

