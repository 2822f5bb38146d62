"""Checked wrappers around the GGUF CUDA kernels of ``candle_vllm._native`` (built with CANDLE_VLLM_CUDA).

Why a separate layer: the kernels take raw device pointers, so the preconditions they rely on (device, dtype,
contiguity, alignment, whole blocks) are checked here once and ``ops/quant.py`` only asks ``*_supported`` and
calls. Kernels launch on the caller's current stream and allocate nothing, outputs come from torch's allocator,
so the calls can be captured in CUDA graphs.
"""

from __future__ import annotations

from typing import Literal

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import HALF_DTYPES, _cache_halves, available, epilogue_target_ok
from candle_vllm.pyengine.ops.q8_activation import BLOCK, Q8Activation, dense


def type_supported(qtype: QT) -> bool:
    """Whether the CUDA kernels decode GGUF blocks of ``qtype`` (the quantized block types, not F32/F16/BF16)."""
    return native.loaded().cuda_gguf_supported(int(qtype))


# Q6_K, Q3_K, Q8_0 and Q5_0 on CUDA (native/cuda/gguf_block.cuh): rows in groups of 8 blocks, a header holding the
# blocks' small fields as planes of 8 (Q6_K, Q8_0: the f16 d; Q3_K: the 12 scale bytes, then the d; Q5_0: the d, then
# the 32-bit qh), then each block's body (its codes), so every 16-byte run a kernel loads is aligned (GGUF's 210-,
# 110-, 34- and 22-byte blocks start 2 bytes off a word every other block). A row's last group holds its remaining
# blocks behind a whole header.
_GROUP = 8
# type -> (the body's offset and length in the GGUF block, the header's fields as (offset, width) in plane order)
_GROUPED: dict[QT, tuple[int, int, tuple[tuple[int, int], ...]]] = {
    QT.Q6_K: (0, 208, ((208, 2),)),
    QT.Q3_K: (0, 96, ((96, 12), (108, 2))),
    QT.Q8_0: (2, 32, ((0, 2),)),
    QT.Q5_0: (6, 16, ((0, 2), (2, 4))),
}


def stored_row_bytes(qtype: QT, cols: int) -> int:
    """Bytes of one ``cols``-element row as the CUDA kernels store it: GGUF's, except for the grouped types, whose
    rows grow where they end on a group of fewer than 8 blocks (the whole header stays)."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks = cols // bs
    if qtype not in _GROUPED:
        return blocks * ts
    _, body, fields = _GROUPED[qtype]
    header = _GROUP * sum(width for _, width in fields)
    full, tail = divmod(blocks, _GROUP)
    return full * (header + _GROUP * body) + (header + body * tail if tail else 0)


def device_layout(data: torch.Tensor, qtype: QT, rows: int, cols: int) -> torch.Tensor:
    """GGUF blocks of a [rows, cols] weight (uint8, any device) as the CUDA kernels read them (flat, contiguous):
    the same bytes for the types GGUF lays out aligned, the grouped types' rows regrouped (see ``stored_row_bytes``).
    Every CUDA GGUF weight goes through this once at load."""
    if qtype not in _GROUPED:
        return data
    body_at, body, fields = _GROUPED[qtype]
    bs, ts = GGML_QUANT_SIZES[qtype]
    blocks, groups = cols // bs, -(-cols // (bs * _GROUP))
    if blocks % _GROUP == 0:
        padded = data.reshape(rows, groups, _GROUP, ts)
    else:  # the last group's empty slots stay zero
        padded = data.new_zeros(rows, groups * _GROUP, ts)
        padded[:, :blocks] = data.reshape(rows, blocks, ts)
        padded = padded.view(rows, groups, _GROUP, ts)
    planes = [padded[..., at : at + width].reshape(rows, groups, -1) for at, width in fields]
    bodies = padded[..., body_at : body_at + body].reshape(rows, groups, -1)
    grouped = torch.cat([*planes, bodies], dim=2).reshape(rows, -1)
    return grouped[:, : stored_row_bytes(qtype, cols)].reshape(-1).contiguous()


def _blocks_ok(data: torch.Tensor, qtype: QT, rows: int, cols: int) -> bool:
    bs, _ = GGML_QUANT_SIZES[qtype]
    return (
        available(data.device)
        and data.dtype == torch.uint8
        and data.is_contiguous()
        and data.data_ptr() % 16 == 0
        and cols % bs == 0
        and data.numel() == rows * stored_row_bytes(qtype, cols)
        and type_supported(qtype)
    )


def gemv_supported(x: torch.Tensor, data: torch.Tensor, qtype: QT, out_features: int, in_features: int) -> bool:
    """True when the fused dequantize + GEMV kernel computes ``x @ W.T``: x [M <= 8, K] f16/bf16 contiguous on
    the weight's CUDA device, W [N, K] as contiguous 16-byte aligned blocks of a supported type."""
    return (
        available(x.device)
        and x.dim() == 2
        and 1 <= x.shape[0] <= native.loaded().cuda_gguf_gemv_max_m
        and x.shape[1] == in_features
        and x.dtype in HALF_DTYPES
        and x.device == data.device
        and x.is_contiguous()
        and x.data_ptr() % 4 == 0
        and _blocks_ok(data, qtype, out_features, in_features)
    )


GemvKernel = Literal["auto", "dp4a", "mma"]


def dp4a_supported(qtype: QT) -> bool:
    """Whether the int8-activation GEMV (x quantized per 32 values, dp4a dot products) handles ``qtype``."""
    return native.loaded().cuda_gguf_gemv_q8_supported(int(qtype))


def gemv(
    x: torch.Tensor | Q8Activation, data: torch.Tensor, qtype: QT, out_features: int, in_features: int,
    kernel: GemvKernel = "auto", rows: int = 0,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T for decode-sized M (<= 8), W read once straight from its GGUF blocks.

    Two kernels: "dp4a" rounds each 32-value block of x to int8 (scale amax / 127, as the CPU kernels do) and
    takes integer dot products with the weight codes, the fast path where the type has one; "mma" keeps x in
    f16/bf16 and multiplies decoded weights on tensor cores (every type, no activation rounding). "auto" picks
    dp4a when the type has it. A :class:`Q8Activation` x brings its codes (written by the kernel that produced
    it): dp4a then skips its quantizer launch, with the same result; mma uses its dense ``x``.

    ``rows`` tunes dp4a's launch and exists so benchmarks can compare launches: the weight rows per CTA (2, 4 or 8
    for one or two tokens, 2 or 4 from three up; 0 = the kernel's default rule, see :func:`gemv_rows`). Every choice
    gives the same bits.
    """
    q8 = x if isinstance(x, Q8Activation) else None
    x = dense(x)
    if not gemv_supported(x, data, qtype, out_features, in_features):
        raise ValueError(
            "gguf gemv needs x [M<=8, K] contiguous f16/bf16 and W as contiguous 16-byte aligned uint8 blocks of a "
            f"supported type on the same CUDA device; {_operands(x, data, qtype, out_features, in_features)}"
        )
    if kernel not in ("auto", "dp4a", "mma"):
        raise ValueError(f"gguf gemv kernel must be 'auto', 'dp4a' or 'mma', got {kernel!r}")
    use_dp4a = dp4a_supported(qtype) if kernel == "auto" else kernel == "dp4a"
    if not use_dp4a and rows:
        raise ValueError("gguf gemv: rows tunes the dp4a kernel; the mma kernel does not take it")
    m, mod = x.shape[0], native.loaded()
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    stream = native.stream(x.device)
    if not use_dp4a:
        mod.cuda_gguf_gemv(
            y.data_ptr(), x.data_ptr(), data.data_ptr(), m, out_features, in_features, int(qtype),
            native.dtype_code(x), stream,
        )
        return y
    to_quantize, xq, xb = _codes(x, q8, in_features)
    if to_quantize is None:
        mod.cuda_gguf_gemv_q8_quantized(
            y.data_ptr(), xq.data_ptr(), xb.data_ptr(), data.data_ptr(), m, out_features, in_features,
            int(qtype), native.dtype_code(x), stream, rows,
        )
    else:
        mod.cuda_gguf_gemv_q8(
            y.data_ptr(), to_quantize.data_ptr(), xq.data_ptr(), xb.data_ptr(), data.data_ptr(), m, out_features,
            in_features, int(qtype), native.dtype_code(x), stream, rows,
        )
    return y


def mmq_supported(x: torch.Tensor, data: torch.Tensor, qtype: QT, out_features: int, in_features: int) -> bool:
    """True when the int8 tensor-core product (:func:`mmq`) computes ``x @ W.T``: x [M, K] with M up to
    ``cuda_gguf_mmq_max_m`` (32) f16/bf16 contiguous on the weight's CUDA device, K a multiple of 256, W [N, K]
    as contiguous 16-byte aligned blocks of a type with a kernel (those of the dp4a GEMV)."""
    mod = native.module() if available(x.device) else None
    return (
        mod is not None
        and mod.cuda_gguf_mmq_supported(int(qtype))
        and x.dim() == 2
        and 1 <= x.shape[0] <= mod.cuda_gguf_mmq_max_m
        and x.shape[1] == in_features
        and in_features % 256 == 0
        and x.dtype in HALF_DTYPES
        and x.device == data.device
        and x.is_contiguous()
        and _blocks_ok(data, qtype, out_features, in_features)
    )


def x_group(qtype: QT) -> int:
    """The values per activation scale :func:`mmq` takes for ``qtype``: 256 for the K-quants (Q8_K's rule, the CPU
    path's for them: a unit's sums then stay integer), 32 for the 32-element types (the dp4a GEMV's codes)."""
    return native.loaded().cuda_gguf_mmq_x_group(int(qtype))


def _codes_taken(q8: Q8Activation | None, qtype: QT) -> Q8Activation | None:
    """q8, or None (quantize again from its dense x) where the tensor-core product cannot read its codes: blocks
    not 16-byte aligned (the kernel reads two at once) or another scale group than :func:`x_group`."""
    if q8 is None or q8.xb.data_ptr() % 16 or not native.loaded().cuda_gguf_mmq_supported(int(qtype)):
        return None
    if q8.group != x_group(qtype):
        return None
    return q8


def mmq(
    x: torch.Tensor | Q8Activation, data: torch.Tensor, qtype: QT, out_features: int, in_features: int,
    row_tiles: int = 0, warps: int = 0, staging: int = 0,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ W.T for decode batches up to 32 rows on int8 tensor cores: x rounded to int8 with one
    scale per :func:`x_group` values (or a :class:`Q8Activation`'s codes of that group), each weight decoded once
    for all rows (the dp4a GEMV decodes it once per row, which bounds it by instruction issue from about 8 rows). A
    row's result does not depend on the other rows of a batch of 1-8 rows, nor of one of 9-32 (for some types the
    two sizes sum in other orders on Hopper: ``cuda_gguf_mmq_warps``). For the 32-element types it differs from the
    dp4a GEMV's by f32 rounding only (the same integer dot products, scaled and summed in another order); the
    K-quants' activations are rounded per 256 values. A :class:`Q8Activation` whose codes the kernel cannot read
    (``_codes_taken``) is quantized again from its dense ``x``.

    ``row_tiles``, ``warps`` and ``staging`` exist so benchmarks can compare launches: 16-row weight tiles per CTA
    (1 or 2), warps per CTA splitting K (4, 8, or 16 with one row tile) and the kernel (1: weights in flight in
    registers; 2: streamed through shared memory, up to ``cuda_gguf_mmq_staged_max_m`` rows on Hopper, no
    ``row_tiles``); 0 = the default rules (warps: by the weight's shape, and for the staged kernel by type too:
    ``cuda_gguf_mmq_warps``; row tiles: also by type and rows; the kernel: the staged one where it fits and no row
    tiles are given). ``row_tiles`` and ``staging`` change only the speed, ``warps`` also the f32 summation order."""
    q8 = x if isinstance(x, Q8Activation) else None
    x = dense(x)
    q8 = _codes_taken(q8, qtype)
    if not mmq_supported(x, data, qtype, out_features, in_features):
        raise ValueError(
            "gguf mmq needs x [M<=32, K % 256 == 0] contiguous f16/bf16 and W as contiguous 16-byte aligned uint8 "
            "blocks of a type with a tensor-core kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K) "
            "on the same CUDA device; "
            + _operands(x, data, qtype, out_features, in_features)
        )
    m = x.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    to_quantize, xq, xb = _codes(x, q8, in_features)
    native.loaded().cuda_gguf_mmq(
        y.data_ptr(), 0 if to_quantize is None else to_quantize.data_ptr(), xq.data_ptr(), xb.data_ptr(),
        data.data_ptr(), m, out_features, in_features, int(qtype), native.dtype_code(x), native.stream(x.device),
        row_tiles, warps, staging,
    )
    return y


def _operands(x: torch.Tensor, data: torch.Tensor, qtype: QT, out_features: int, in_features: int) -> str:
    """What a refused GEMV call was given, for its error message."""
    return (
        f"got x {tuple(x.shape)} {x.dtype} {x.device}, {QT(qtype).name} data of {data.numel()} bytes for "
        f"[{out_features}, {in_features}]"
    )


def _codes(
    x: torch.Tensor, q8: Q8Activation | None, in_features: int
) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """The dp4a GEMV's int8 inputs: q8's codes (checked; nothing to quantize), or scratch for the GEMV's own
    quantizer launch with the 16-byte aligned x it reads."""
    m, xblock_bytes = x.shape[0], native.loaded().cuda_gguf_xblock_bytes
    if q8 is not None:
        _check_codes(q8, m, in_features, xblock_bytes)
        return None, q8.xq, q8.xb
    if x.data_ptr() % 16:
        x = x.clone()  # the activation quantizer reads 16-byte aligned rows
    xq = torch.empty(m * in_features, dtype=torch.int8, device=x.device)
    xb = torch.empty(m * in_features // BLOCK * xblock_bytes, dtype=torch.uint8, device=x.device)
    return x, xq, xb


def gemv_rope_cache(
    x: torch.Tensor | Q8Activation,
    data: torch.Tensor,
    qtype: QT,
    out_features: int,
    in_features: int,
    head_dim: int,
    kv_heads: int,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows: int = 0,
    tensor_cores: bool = False,
) -> torch.Tensor | None:
    """The fused q/k/v projection of a decode batch with neox RoPE and the k/v cache store in its epilogue: one
    launch instead of the product plus ``rotary_embedding_cache_``. The product is the dp4a GEMV (M <= 8), or with
    ``tensor_cores`` the int8 tensor-core product of :func:`mmq` (M <= 32; ``rows`` must stay 0).

    ``data`` holds W [q_rows + 2 * kv_heads * head_dim, K] with each q and k head's halves interleaved row by row
    (``ops.row_pairs.interleave_halves(rows, head_dim, 1)`` on the q/k block rows), so the GEMV's CTAs, which own
    an even number of consecutive rows, hold whole rotation pairs. Returns y [M, N] in the standard layout, q and
    k rotated (bit for bit as the product then ``rotary_embedding_cache_(..., pair_group=1)`` leave them), with k and
    v stored at ``slot_mapping`` (negative: skipped) in ``kv_cache`` [2, blocks, block_size, kv_heads, head_dim];
    None (nothing done) where the kernel does not apply. x's codes (a :class:`Q8Activation`) spare the quantizer
    launch; ``rows`` as in :func:`gemv`."""
    q8 = x if isinstance(x, Q8Activation) else None
    x = dense(x)
    d = head_dim
    rot_rows = out_features - kv_heads * d
    if tensor_cores:
        q8 = _codes_taken(q8, qtype)
    product_ok = (
        mmq_supported(x, data, qtype, out_features, in_features) and rows == 0
        if tensor_cores
        else gemv_supported(x, data, qtype, out_features, in_features) and dp4a_supported(qtype)
    )
    if not (
        product_ok
        and d > 0
        and d % 2 == 0
        and rot_rows > kv_heads * d
        and (rot_rows - kv_heads * d) % d == 0
        and epilogue_target_ok(x, kv_heads, d, positions, cos_sin_cache, kv_cache, slot_mapping)
    ):
        return None
    m = x.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype, device=x.device)
    to_quantize, xq, xb = _codes(x, q8, in_features)
    kp, vp = _cache_halves(kv_cache)
    native.loaded().cuda_gguf_gemv_q8_rope_cache(
        y.data_ptr(), 0 if to_quantize is None else to_quantize.data_ptr(), xq.data_ptr(), xb.data_ptr(),
        data.data_ptr(), m, out_features, in_features, int(qtype), native.dtype_code(x), positions.data_ptr(),
        cos_sin_cache.data_ptr(), kp, vp, slot_mapping.data_ptr(),
        rot_rows - kv_heads * d, rot_rows, d, kv_heads, native.stream(x.device), rows, tensor_cores,
        kv_cache.dtype == torch.float8_e4m3fn,
    )
    return y


def gemv_rows(qtype: QT, m: int, out_features: int, in_features: int, rows: int = 0) -> int:
    """The weight rows per CTA the dp4a GEMV launches with for ``m`` tokens and an ``out_features`` x
    ``in_features`` weight on the current CUDA device (``rows = 0`` resolved by the kernel's default rule: per type,
    for Q2_K by the weight's size, and for Q4_K/Q5_K at one token and every type at two by wave efficiency over the
    device's SMs), so benchmarks and tests can tell which launch is the default."""
    return native.loaded().cuda_gguf_gemv_q8_rows(int(qtype), m, out_features, in_features, rows)


def _check_codes(q8: Q8Activation, m: int, k: int, xblock_bytes: int) -> None:
    xq, xb = q8.xq, q8.xb
    if not (
        xq.dtype == torch.int8 and xq.shape == (m, k) and xq.is_contiguous() and xq.data_ptr() % 16 == 0
        and xb.dtype == torch.uint8 and xb.shape == (m, k // BLOCK * xblock_bytes) and xb.is_contiguous()
        and xb.data_ptr() % 8 == 0 and xq.device == xb.device == q8.x.device
    ):
        raise ValueError(
            f"gguf gemv: quantized activations for x [{m}, {k}] need int8 codes [{m}, {k}] (16-byte aligned) and "
            f"uint8 blocks [{m}, {k // BLOCK * xblock_bytes}] (8-byte aligned), contiguous on x's device; got "
            f"{xq.dtype} {tuple(xq.shape)} and {xb.dtype} {tuple(xb.shape)}"
        )


def dequantize_supported(data: torch.Tensor, qtype: QT, rows: int, cols: int, dtype: torch.dtype) -> bool:
    """True when :func:`dequantize` decodes these blocks on the GPU into ``dtype``."""
    return dtype in native.FLOAT_DTYPES and _blocks_ok(data, qtype, rows, cols)


def dequantize(
    data: torch.Tensor, qtype: QT, rows: int, cols: int, dtype: torch.dtype, ids: torch.Tensor | None = None
) -> torch.Tensor:
    """Decode the [rows, cols] weight (or, with int64 ``ids`` [T], its rows ids) into a new ``dtype`` tensor.

    f32 output equals ``gguf.quants.dequantize`` exactly (same f32 operations); f16/bf16 round that once. Row
    gathering serves quantized embeddings: only the looked-up rows are decoded. ``ids`` are not bounds-checked
    on the device (that would need a host sync), so callers pass valid token ids.
    """
    if not dequantize_supported(data, qtype, rows, cols, dtype):
        raise ValueError(
            f"gguf dequantize needs contiguous 16-byte aligned uint8 CUDA blocks of a supported type and an "
            f"f32/f16/bf16 output; got {QT(qtype).name} data of {data.numel()} bytes for [{rows}, {cols}] -> {dtype}"
        )
    ids_ptr = 0
    out_rows = rows
    if ids is not None:
        if ids.dtype != torch.int64 or ids.device != data.device or ids.dim() != 1:
            raise ValueError("gguf dequantize: ids must be a 1-D int64 tensor on the weight's device")
        ids = ids.contiguous()
        ids_ptr, out_rows = ids.data_ptr(), ids.numel()
    out = torch.empty(out_rows, cols, dtype=dtype, device=data.device)
    native.loaded().cuda_gguf_dequantize(
        out.data_ptr(), data.data_ptr(), ids_ptr, out_rows, cols, int(qtype), native.dtype_code(out),
        native.stream(data.device),
    )
    return out


def type_supported_on(device: torch.device, qtype: QT) -> bool:
    """Whether quantized matmuls of ``qtype`` on ``device`` run the CUDA kernels (built, not forced off)."""
    return available(device) and type_supported(qtype)
