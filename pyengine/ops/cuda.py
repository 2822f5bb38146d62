"""Checked wrappers around the CUDA kernels of ``candle_vllm._native`` (built with CANDLE_VLLM_CUDA).

Why a separate layer: the kernels take raw device pointers, so every precondition they rely on (device,
dtype, contiguity, 16-byte alignment, size limits) is checked here once, and the op dispatchers
(``ops/norm.py``, ``ops/activation.py``, ``ops/rotary.py``, ``ops/attention.py``) and the linear layers only ask
``*_supported`` and call. Every kernel launches on the caller's current stream and allocates only through
torch, so the calls can be captured in CUDA graphs (after one warm-up call outside capture, which creates the
split-K counters).
"""

from __future__ import annotations

import functools
import math

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation, codes_for, producer_supported

HALF_DTYPES = (torch.float16, torch.bfloat16)
_COUNTER_SLOTS = 1 << 16  # split-K tiles of 16 rows: covers N up to ~1M


def available(device: torch.device) -> bool:
    """Whether the CUDA kernels can run on ``device`` (built with CUDA, not forced to the references)."""
    return device.type == "cuda" and native.available(device)


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def deferred_norm_ok(norm: DeferredRMSNorm | None, like: torch.Tensor, tokens: int) -> bool:
    """Whether a kernel consuming ``like`` (its output of ``tokens`` rows) can apply ``norm`` (None: nothing to
    apply): rows [tokens, H] of like's dtype and device, H and the token stride in 16-byte vectors, aligned."""
    if norm is None:
        return True
    rows, vec = norm.rows, 16 // like.element_size()
    return (rows.dim() == 2 and rows.shape[0] == tokens and rows.dtype == like.dtype and rows.device == like.device
            and rows.stride(1) == 1 and rows.shape[1] % vec == 0 and rows.stride(0) % vec == 0 and _aligned(rows))


def deferred_norm_args(norm: DeferredRMSNorm | None) -> tuple[int, int, int, float]:
    """The kernels' (rows pointer, token stride, hidden, eps) of ``norm``; a null pointer for none."""
    if norm is None:
        return 0, 0, 0, 0.0
    return norm.rows.data_ptr(), norm.rows.stride(0), norm.rows.shape[1], norm.eps


@functools.cache
def sm_count(device_index: int) -> int:
    """Multiprocessors of a GPU: the work-splitting heuristics size grids to fill them."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _split_counters(device_index: int) -> torch.Tensor:
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("skinny_gemm: call it once before CUDA-graph capture (its split-K counters are created then)")
    return torch.zeros(_COUNTER_SLOTS, dtype=torch.int32, device=torch.device("cuda", device_index))


# ---- skinny GEMM (decode linear layers) -------------------------------------------------------------------


def gemm_operands_ok(x: torch.Tensor, weight: torch.Tensor, max_m: int, k_dim: int = 1) -> bool:
    """What the native decode GEMMs need of ``x @ weight.T``: 2-D x [1..max_m, K], weight [N, K] (``k_dim`` 0: a
    weight stored [K, N]), both f16/bf16 of one dtype on one CUDA device, contiguous, 16-byte aligned, K a multiple
    of 8."""
    return (
        available(x.device)
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype in HALF_DTYPES
        and weight.dtype == x.dtype
        and weight.device == x.device
        and 1 <= x.shape[0] <= max_m
        and x.shape[1] == weight.shape[k_dim]
        and x.shape[1] % 8 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and _aligned(x, weight)
    )


def skinny_gemm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` can run on the skinny kernel (:func:`gemm_operands_ok` with M <= 16)."""
    return available(x.device) and gemm_operands_ok(x, weight, native.loaded().cuda_skinny_max_m)


def skinny_gemm_splits(n: int, k: int, sms: int, warps: int = 4) -> int:
    """K splits for an [N, K] weight: one as soon as the 16-row tiles give every SM a CTA (measured on the
    H200, 2026-11-30: splitting 4096x4096 or 4096x14336 gained <= 10% at M=1 and lost 20-30% at M=16), else
    enough to reach about two CTAs per SM, keeping at least one chunk of 128 k per warp in each split.
    M > 16 stays on cuBLAS: a 64-row-tile variant measured 0.26-0.94x cuBLAS on the 8B shapes (RESULTS.md)."""
    tiles = math.ceil(n / 16)
    chunks = math.ceil(k / native.loaded().cuda_skinny_chunk_k)
    if tiles >= sms:
        return 1
    splits = max(1, min(math.ceil(2 * sms / tiles), chunks // warps))
    per_split = math.ceil(chunks / splits)
    return math.ceil(chunks / per_split)


def skinny_gemm_warps(m: int, n: int, sms: int) -> int:
    """CTA size for an [N, K] weight at M rows: 8 warps where the 16-row tiles leave at most two CTAs per SM
    and one token group (M <= 8), else 4. H200, 2026-11-30 (`bench_kernels.py --only gemm`): M=1 o_proj
    4096x4096 9.4 vs 11.8 us, down 4096x14336 28.3 vs 31.7 us; qkv (384 tiles) 14.4 vs 13.6 and gate_up even;
    at M=16 (two token groups, 165 registers) 4 warps win everywhere."""
    return 8 if m <= 8 and math.ceil(n / 16) <= 2 * sms else 4


def _skinny_launch_args(
    x: torch.Tensor, weight: torch.Tensor, splits: int | None, warps: int | None
) -> tuple[int, int, int, int, int, torch.Tensor | None, int]:
    """Checks a skinny GEMM's operands and picks its CTA size and split-K: (M, N, K, splits, warps, the f32
    partials buffer or None, the counters pointer or 0). The caller holds the buffer until the launch is queued."""
    if warps not in (None, 4, 8):
        raise ValueError(f"skinny_gemm: warps must be 4 or 8, got {warps}")
    if not skinny_gemm_supported(x, weight):
        raise ValueError(
            "skinny_gemm needs x [M<=16, K] and weight [N, K] contiguous f16/bf16 CUDA tensors of one dtype, "
            f"16-byte aligned, K % 8 == 0; got x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0]
    dev = _device_index(x.device)
    if warps is None:
        warps = skinny_gemm_warps(m, n, sm_count(dev))
    if splits is None:
        splits = skinny_gemm_splits(n, k, sm_count(dev), warps)
    partials, counters_ptr = None, 0
    if splits > 1:
        if math.ceil(n / 16) > _COUNTER_SLOTS:
            raise ValueError(f"skinny_gemm: split-K supports N up to {_COUNTER_SLOTS * 16}; use splits=1")
        partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
        counters_ptr = _split_counters(dev).data_ptr()
    return m, n, k, splits, warps, partials, counters_ptr


def skinny_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    splits: int | None = None,
    warps: int | None = None,
    silu_mul: bool = False,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K].T for decode-sized M (<= 16), reading the weight once at HBM speed.

    ``splits`` and ``warps`` (4 or 8) override the split-K and CTA-size heuristics (benchmarks sweep both); the
    result does not depend on either beyond f32 summation order. ``silu_mul``: weight is a gate/up projection
    interleaved in groups of 8 rows (``ops.activation.interleave_gate_up``, N % 16 == 0) and the result is
    y [M, N / 2] = silu(gate) * up, rounded as the projection followed by ``silu_and_mul`` rounds it (the SiLU
    costs no launch of its own).
    """
    if silu_mul and weight.shape[0] % 16:
        raise ValueError(f"skinny_gemm: silu_mul needs an interleaved gate/up weight of 16k rows, got {weight.shape[0]}")
    m, n, k, splits, warps, partials, counters_ptr = _skinny_launch_args(x, weight, splits, warps)
    partials_ptr = 0 if partials is None else partials.data_ptr()
    y = torch.empty(m, n // 2 if silu_mul else n, dtype=x.dtype, device=x.device)
    native.loaded().cuda_skinny_gemm(
        y.data_ptr(), x.data_ptr(), weight.data_ptr(), partials_ptr, counters_ptr, m, n, k, splits, warps, silu_mul,
        native.dtype_code(x), native.stream(x.device),
    )
    return y


def epilogue_target_ok(
    x: torch.Tensor,
    kv_heads: int,
    head_dim: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> bool:
    """Whether a decode GEMM's RoPE + cache epilogue can rotate x's [M, ...] projection with this table and store
    into this cache: whole-head rotary from an f32 table, a contiguous cache [2, blocks, block_size, kv_heads,
    head_dim] in x's dtype (or e4m3), int64 positions and slots, one per row, all on x's device."""
    return (
        cache_holds(kv_cache, x.dtype)
        and kv_cache.is_contiguous()
        and kv_cache.dim() == 5
        and tuple(kv_cache.shape[3:]) == (kv_heads, head_dim)
        and cos_sin_cache.dtype == torch.float32
        and cos_sin_cache.is_contiguous()
        and cos_sin_cache.shape[-1] == head_dim
        and positions.dtype == slot_mapping.dtype == torch.int64
        and positions.is_contiguous()
        and slot_mapping.is_contiguous()
        and positions.numel() == slot_mapping.numel() == x.shape[0]
        and all(t.device == x.device for t in (kv_cache, cos_sin_cache, positions, slot_mapping))
    )


def skinny_gemm_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    head_dim: int,
    kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    splits: int | None = None,
    warps: int | None = None,
) -> torch.Tensor | None:
    """The fused q/k/v projection of a decode batch with neox RoPE and the k/v cache store in the GEMM's
    epilogue: one launch instead of the projection plus ``rotary_embedding_cache_``.

    ``weight`` [q_rows + 2 * kv_heads * head_dim, K] has each q and k head's halves interleaved in groups of 8
    rows (``ops.activation.interleave_halves(w, head_dim)`` on the q/k rows), so a 16-row tile holds both members
    of 8 rotation pairs. Returns y [M, N] in the standard layout, q and k rotated (exactly as the projection then
    ``rotary_embedding_cache_`` leave them), with k and v stored at ``slot_mapping`` in ``kv_cache`` [2, blocks,
    block_size, kv_heads, head_dim]; None (nothing done) where the kernel does not apply."""
    d = head_dim
    rot_rows = weight.shape[0] - kv_heads * d
    if not (
        skinny_gemm_supported(x, weight)
        and d % 16 == 0
        and rot_rows > kv_heads * d
        and (rot_rows - kv_heads * d) % d == 0
        and epilogue_target_ok(x, kv_heads, d, positions, cos_sin_cache, kv_cache, slot_mapping)
    ):
        return None
    m, n, k, splits, warps, partials, counters_ptr = _skinny_launch_args(x, weight, splits, warps)
    partials_ptr = 0 if partials is None else partials.data_ptr()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    kp, vp = _cache_halves(kv_cache)
    native.loaded().cuda_skinny_gemm_rope_cache(
        y.data_ptr(), x.data_ptr(), weight.data_ptr(), partials_ptr, counters_ptr, m, n, k, splits, warps,
        positions.data_ptr(), cos_sin_cache.data_ptr(), kp, vp, slot_mapping.data_ptr(), rot_rows - kv_heads * d,
        rot_rows, d, kv_heads, kv_cache.dtype == torch.float8_e4m3fn, native.dtype_code(x), native.stream(x.device),
    )
    return y


# ---- element-wise layers -----------------------------------------------------------------------------------


def silu_and_mul(x: torch.Tensor, *, q8: int = 0) -> torch.Tensor | Q8Activation | None:
    """``silu(x[..., :d]) * x[..., d:]`` on the GPU, or None when x is not a contiguous float CUDA tensor. With
    ``q8`` (a scale group, 32 or 256) and a shape the code-writing kernel takes, the output with its int8 codes
    (ops/q8_activation.py)."""
    if not (available(x.device) and x.dtype in native.FLOAT_DTYPES and x.is_contiguous() and x.shape[-1] % 2 == 0):
        return None
    d = x.shape[-1] // 2
    tokens = x.numel() // max(1, x.shape[-1])
    if tokens > 65535:
        return None
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if q8 and producer_supported(out, q8, x):
        act = codes_for(out, q8)
        native.loaded().cuda_silu_and_mul_q8(
            out.data_ptr(), act.xq.data_ptr(), act.xb.data_ptr(), q8, x.data_ptr(), tokens, d,
            native.dtype_code(x), native.stream(x.device),
        )
        return act
    native.loaded().cuda_silu_and_mul(
        out.data_ptr(), x.data_ptr(), tokens, d, native.dtype_code(x), native.stream(x.device)
    )
    return out


def silu_and_mul_interleaved(x: torch.Tensor, norm: DeferredRMSNorm | None = None) -> torch.Tensor | None:
    """:func:`silu_and_mul` of a projection whose gate and up features alternate in groups of 8
    (``ops.activation.interleave_gate_up``), gate and up first scaled per token by ``norm`` where given; None when
    x is not a contiguous, 16-byte aligned f16/bf16 CUDA tensor with d % 8 == 0 (or the norm's rows do not fit
    :func:`deferred_norm_ok`)."""
    if not (available(x.device) and x.dtype in HALF_DTYPES and x.is_contiguous() and x.shape[-1] % 16 == 0):
        return None
    d = x.shape[-1] // 2
    tokens = x.numel() // max(1, x.shape[-1])
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    if tokens > 65535 or not _aligned(x, out) or not deferred_norm_ok(norm, x, tokens):
        return None
    native.loaded().cuda_silu_and_mul_interleaved(
        out.data_ptr(), x.data_ptr(), tokens, d, native.dtype_code(x), native.stream(x.device),
        *deferred_norm_args(norm),
    )
    return out


def cache_holds(kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the CUDA kernels read and write ``kv_cache`` for activations of ``dtype``: a cache of that dtype,
    or an e4m3 cache (``--kvcache-dtype fp8``) for f16/bf16 activations."""
    return kv_cache.dtype == dtype or (kv_cache.dtype == torch.float8_e4m3fn and dtype in HALF_DTYPES)


def _cache_halves(kv_cache: torch.Tensor) -> tuple[int, int]:
    """Device pointers of the K and V halves of a paged cache [2, blocks, block_size, Hk, D]."""
    return kv_cache[0].data_ptr(), kv_cache[1].data_ptr()


def _heads_view_ok(t: torch.Tensor) -> bool:
    """[T, H, D] with D contiguous and heads packed, any token stride (views into a fused qkv buffer)."""
    return t.dim() == 3 and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


# ---- sampling ----------------------------------------------------------------------------------------------


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """int64 [B] argmax of logits [B, V] (f32/f16/bf16) on the GPU; ties and NaN resolve as torch.argmax."""
    if not (available(logits.device) and logits.dim() == 2 and logits.dtype in native.FLOAT_DTYPES):
        raise ValueError("argmax: needs 2-D f32/f16/bf16 CUDA logits")
    logits = logits.contiguous()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    native.loaded().cuda_argmax(
        out.data_ptr(), logits.data_ptr(), logits.shape[0], logits.shape[1], native.dtype_code(logits),
        native.stream(logits.device),
    )
    return out
