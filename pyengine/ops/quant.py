"""GGUF quantized weights: dequantize and ``y = x @ W.T`` straight from the raw GGUF blocks (contract A).

Weights stay in their GGUF block encoding (a uint8 tensor) so a quantized model keeps its small memory
footprint. On CPU the native kernels decode blocks on the fly (decode-sized batches: integer dot products with
8-bit quantized activations, as llama.cpp does). On CUDA, decode batches (<= 8 rows) run a fused GEMV that reads
each quantized byte once (int8-quantized activations and dp4a for the types that have it, else f16/bf16
activations on tensor cores), larger batches dequantize W into a scratch tensor and multiply with cuBLAS
through torch. Elsewhere the weight is dequantized and multiplied with torch. The pure-torch dequantizers below are
the reference the native kernels are tested against, and what runs on devices without native kernels.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable

import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import cuda_gguf, native
from candle_vllm.pyengine.ops.q8_activation import BLOCK, Q8Activation, dense

SUPPORTED_TYPES: frozenset[QT] = frozenset(
    {
        QT.F32,
        QT.F16,
        QT.BF16,
        QT.Q4_0,
        QT.Q4_1,
        QT.Q5_0,
        QT.Q5_1,
        QT.Q8_0,
        QT.Q2_K,
        QT.Q3_K,
        QT.Q4_K,
        QT.Q5_K,
        QT.Q6_K,
    }
)



def check_supported(qtype: QT) -> None:
    """Raise a ValueError naming the type when candle-vllm has no kernels for it."""
    if qtype not in SUPPORTED_TYPES:
        names = ", ".join(sorted(t.name for t in SUPPORTED_TYPES))
        raise ValueError(
            f"GGUF tensor type {QT(qtype).name} is not supported (supported: {names}); "
            "use a GGUF file quantized to one of these types"
        )


def block_size(qtype: QT) -> int:
    """Elements per block of ``qtype`` (1 for the float types)."""
    return GGML_QUANT_SIZES[qtype][0]


def type_size(qtype: QT) -> int:
    """Bytes per block of ``qtype``."""
    return GGML_QUANT_SIZES[qtype][1]


def row_bytes(qtype: QT, n: int) -> int:
    """Bytes holding one row of ``n`` elements of ``qtype``; ``n`` must be a whole number of blocks."""
    bs, ts = GGML_QUANT_SIZES[qtype]
    if n % bs:
        raise ValueError(
            f"a {QT(qtype).name} row of {n} elements is not a whole number of {bs}-element blocks"
        )
    return n // bs * ts


# ---- pure-torch reference dequantizers: [n_blocks, type_size] uint8 -> [n_blocks, block_size] f32 ----


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte offset ``at`` of every block, as f32 [n, 1]."""
    return blocks[:, at : at + 2].contiguous().view(torch.float16).float()


def _shifts(values: list[int], shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8, device=device).view(shape)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[n, 16] packed bytes -> [n, 32] codes: the low nibbles, then the high nibbles."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """[n, 4] bytes -> [n, 32]: bit j of the little-endian word at position j."""
    return ((qh.unsqueeze(-1) >> _shifts(list(range(8)), (1, 1, 8), qh.device)) & 1).reshape(qh.shape[0], 32)


def _deq_q4_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * (_nibbles(b[:, 2:]).float() - 8)


def _deq_q4_1(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * _nibbles(b[:, 4:]).float() + _f16(b, 2)


def _deq_q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 6:]) | (_bits32(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.float() - 16)


def _deq_q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 8:]) | (_bits32(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.float() + _f16(b, 2)


def _deq_q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b, 0) * b[:, 2:].view(torch.int8).float()


def _planes2(qs: torch.Tensor) -> torch.Tensor:
    """K types' 2-bit planes: [n, 64] -> [n, 256], element 128*half + 32*shift + l from byte 32*half + l."""
    n = qs.shape[0]
    return ((qs.view(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), qs.device)) & 3).reshape(n, 256)


def _deq_q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales, q = b[:, :16], _planes2(b[:, 16:80]).view(n, 16, 16).float()
    dl = (_f16(b, 80) * (scales & 0x0F).float()).view(n, 16, 1)
    ml = (_f16(b, 82) * (scales >> 4).float()).view(n, 16, 1)
    return (dl * q - ml).reshape(n, 256)


def _q3k_scales(sc: torch.Tensor) -> torch.Tensor:
    """Q3_K's 12 packed bytes -> 16 signed 6-bit scales (minus 32), as f32."""
    n = sc.shape[0]
    low = torch.cat([sc[:, :8] & 0x0F, sc[:, :8] >> 4], dim=1)
    high = ((sc[:, 8:12].view(n, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), sc.device)) & 3).reshape(n, 16)
    return (low | (high << 4)).float() - 32


def _deq_q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask = b[:, :32]
    high = ((hmask.view(n, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), b.device)) & 1).reshape(n, 256)
    q = _planes2(b[:, 32:96]).float() - 4 * (1 - high.float())
    dl = (_f16(b, 108) * _q3k_scales(b[:, 96:108])).view(n, 16, 1)
    return (dl * q.view(n, 16, 16)).reshape(n, 256)


def _k4_scale_min(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 packed bytes -> (8 scales, 8 mins), 6 bits each, as f32."""
    d, m, md = sc[:, 0:4], sc[:, 4:8], sc[:, 8:12]
    scale = torch.cat([d & 63, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale.float(), mins.float()


def _nibble_planes(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K codes: [n, 128] -> [n, 8, 32], sub-block 2i+t from the nibble t of bytes 32i..32i+31."""
    n = qs.shape[0]
    return ((qs.view(n, 4, 1, 32) >> _shifts([0, 4], (1, 1, 2, 1), qs.device)) & 0x0F).reshape(n, 8, 32)


def _deq_q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, mins = _k4_scale_min(b[:, 4:16])
    q = _nibble_planes(b[:, 16:144]).float()
    return ((_f16(b, 0) * scale).view(n, 8, 1) * q - (_f16(b, 2) * mins).view(n, 8, 1)).reshape(n, 256)


def _deq_q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scale, mins = _k4_scale_min(b[:, 4:16])
    high = (b[:, 16:48].view(n, 1, 32) >> _shifts(list(range(8)), (1, 8, 1), b.device)) & 1
    q = (_nibble_planes(b[:, 48:176]) | (high << 4)).float()
    return ((_f16(b, 0) * scale).view(n, 8, 1) * q - (_f16(b, 2) * mins).view(n, 8, 1)).reshape(n, 256)


def _deq_q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    low = ((b[:, :128].view(n, 2, 1, 64) >> _shifts([0, 4], (1, 1, 2, 1), b.device)) & 0x0F).reshape(n, 256)
    high = ((b[:, 128:192].view(n, 2, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 3).reshape(
        n, 256
    )
    q = (low | (high << 4)).float() - 32
    dl = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float()).view(n, 16, 1)
    return (dl * q.view(n, 16, 16)).reshape(n, 256)


_REFERENCE: dict[QT, Callable[[torch.Tensor], torch.Tensor]] = {
    QT.F32: lambda b: b.contiguous().view(torch.float32),
    QT.F16: lambda b: b.contiguous().view(torch.float16).float(),
    QT.BF16: lambda b: b.contiguous().view(torch.bfloat16).float(),
    QT.Q4_0: _deq_q4_0,
    QT.Q4_1: _deq_q4_1,
    QT.Q5_0: _deq_q5_0,
    QT.Q5_1: _deq_q5_1,
    QT.Q8_0: _deq_q8_0,
    QT.Q2_K: _deq_q2_k,
    QT.Q3_K: _deq_q3_k,
    QT.Q4_K: _deq_q4_k,
    QT.Q5_K: _deq_q5_k,
    QT.Q6_K: _deq_q6_k,
}


def _in_device_layout(data: torch.Tensor, qtype: QT) -> bool:
    """Whether ``data`` is kept in the CUDA kernels' layout (``cuda_gguf.device_layout``): GGUF weights on a CUDA
    device whose kernels decode the type, as ``quant.GGUFLinear`` stores them."""
    return data.device.type == "cuda" and cuda_gguf.type_supported_on(data.device, qtype)


def _as_bytes(data: torch.Tensor, qtype: QT, shape: tuple[int, ...], gguf_layout: bool = False) -> torch.Tensor:
    """Check that ``data`` holds exactly the blocks of a ``shape`` tensor (in GGUF's layout, or the CUDA kernels'
    where ``_in_device_layout`` and not ``gguf_layout``) and return them as flat uint8."""
    check_supported(qtype)
    if not shape:
        raise ValueError("a quantized tensor needs at least one dimension")
    rows = 1
    for dim in shape[:-1]:
        rows *= dim
    row_nbytes = row_bytes(qtype, shape[-1])
    if not gguf_layout and _in_device_layout(data, qtype):
        row_nbytes = cuda_gguf.stored_row_bytes(qtype, shape[-1])
    expected = rows * row_nbytes
    flat = data.reshape(-1) if data.dtype == torch.uint8 else data.contiguous().view(torch.uint8).reshape(-1)
    if flat.numel() != expected:
        raise ValueError(
            f"{QT(qtype).name} data for shape {tuple(shape)} must be {expected} bytes, got {flat.numel()}"
        )
    # Native kernels read the blocks in place: give them a contiguous buffer, 16-byte aligned for CUDA's wide loads.
    if not flat.is_contiguous() or flat.data_ptr() % 16:
        flat = flat.clone()
    return flat


def dequantize_reference(
    data: torch.Tensor, qtype: QT, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode GGUF blocks (GGUF's layout on every device) with torch ops only; the oracle for the native kernels."""
    flat = _as_bytes(data, qtype, shape, gguf_layout=True)
    blocks = flat.view(-1, type_size(qtype))
    return _REFERENCE[qtype](blocks).reshape(shape).to(dtype)


def dequantize(
    data: torch.Tensor, qtype: QT, shape: tuple[int, ...], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Decode the GGUF blocks ``data`` of a tensor of logical ``shape`` into a ``dtype`` tensor (on CUDA in the
    kernels' layout, ``cuda_gguf.device_layout``)."""
    flat = _as_bytes(data, qtype, shape)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    if cuda_gguf.dequantize_supported(flat, qtype, rows, cols, dtype):
        return cuda_gguf.dequantize(flat, qtype, rows, cols, dtype).view(shape)
    if _in_device_layout(flat, qtype):
        raise ValueError(f"dequantize of CUDA GGUF weights gives f32, f16 or bf16, not {dtype}")
    if data.device.type == "cpu" and dtype in native.FLOAT_DTYPES and native.available(data.device):
        out = torch.empty(shape, dtype=dtype)
        cols = shape[-1]
        native.loaded().cpu_dequantize(
            native.ptr(out),
            native.ptr(flat),
            out.numel() // cols,
            cols,
            int(qtype),
            native.DTYPE_CODES[dtype],
        )
        return out
    return dequantize_reference(flat, qtype, shape, dtype)


def quant_matmul_reference(
    x: torch.Tensor, data: torch.Tensor, qtype: QT, out_features: int, in_features: int
) -> torch.Tensor:
    """``x @ W.T`` by dequantizing W to x's dtype and a dense matmul (any device)."""
    w = dequantize_reference(data, qtype, (out_features, in_features), x.dtype)
    return torch.matmul(x, w.t())


def quant_matmul(
    x: torch.Tensor | Q8Activation, data: torch.Tensor, qtype: QT, out_features: int, in_features: int
) -> torch.Tensor:
    """``y = x @ W.T`` for W [out_features, in_features] stored as GGUF blocks ``data``.

    x is [..., in_features] in f32/f16/bf16; y is [..., out_features] in x.dtype. On CPU every batch size runs
    the fused native kernel (W never materialised). Each row of x goes through the same arithmetic whatever
    the batch holds, so a request's tokens never depend on the requests sharing its step (batch invariance);
    a dense torch GEMM for large batches would be up to 1.5x faster in prefill but rounds differently. On CUDA
    a row's result depends only on which kernel its batch size selects (see :func:`_cuda_quant_matmul`).
    A :class:`Q8Activation` x (int8 codes written by its producer) saves the CUDA dp4a GEMV or tensor-core product
    its quantizer launch, same result; every other path uses its dense ``x``.
    """
    q8 = x if isinstance(x, Q8Activation) else None
    x = dense(x)
    if x.shape[-1] != in_features:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {in_features}")
    if x.dtype not in native.FLOAT_DTYPES:
        raise ValueError(f"quant_matmul needs f32, f16 or bf16 activations, got {x.dtype}")
    flat = _as_bytes(data, qtype, (out_features, in_features))
    rows = x.numel() // in_features
    if x.device.type == "cuda" and cuda_gguf.type_supported_on(x.device, qtype):
        return _cuda_quant_matmul(x, flat, qtype, out_features, in_features, q8)
    if x.device.type != "cpu" or not native.available(x.device):
        return quant_matmul_reference(x, flat, qtype, out_features, in_features)
    xc = x.contiguous()
    y = torch.empty((*x.shape[:-1], out_features), dtype=x.dtype)
    native.loaded().cpu_quant_matmul(
        native.ptr(y),
        native.ptr(xc),
        native.ptr(flat),
        rows,
        out_features,
        in_features,
        int(qtype),
        native.DTYPE_CODES[x.dtype],
        False,
    )
    return y


# Decode batches of types without the tensor-core product (below) run the fused GEMV in 8-row passes up to this
# many rows (each pass reads the quantized weights once); beyond it dequantize + cuBLAS is cheaper. At 16 rows two
# q4k passes read 10 GB per 8B step against ~35 GB for dequantizing to bf16 and multiplying; at 24 they would break
# even (benches/RESULTS.md).
GEMV_PASSES_MAX_ROWS = 16
# Types with the int8 tensor-core product (cuda_gguf.mmq) take it from a number of rows up to its maximum (32): it
# decodes each weight once for all rows, where the dp4a GEMV decodes it once per row (and runs 3-4 rows as 4, 5-8
# as 8). The number is the smallest batch from which it beat the dp4a GEMV on the H200, separately for narrow weights
# and for wide ones (out_features >= MMQ_WIDE_FEATURES), in two tables: one for weights its staged kernel (up to 8
# rows: weights streamed through shared memory, gguf_mmq_staged.cu; Hopper, rows a whole number of 16-byte granules)
# takes, one for those only its register kernel takes.
#
# MMQ_MIN_ROWS, with the staged kernel (session 21, call 6: benches/bench_quant_cuda.py --kernels dp4a mmq
# --mmq-staging 0 1 --codes --m 1 2 3 4 5 6 8, benches/RESULTS.md; us summed over the narrow 8B shapes 6144x4096 +
# 4096x4096 + 4096x14336 / the wide 28672x4096, dp4a against the staged kernel, at the number and one row below it):
#   - q4k at 2: 35 / 27 and 34 / 25; q5k at 2: 37 / 34 and 40 / 28; q6k at 2: 50 / 47 and 48 / 40; q2k at 2: 35 / 31
#     and 38 / 25; q3k narrow at 3: 48 / 46 (2: 41 / 44), wide at 2: 44 / 39.
#   - q5_0 at 3: 56 / 48 and 68 / 37 (2: 30 / 44, 33 / 36); q8_0 narrow at 5: 57 / 46 (4: 40 / 46), wide at 3: 46 /
#     44 (2: 35 / 43); q4_0 narrow at 5: 54 / 41 (4: 34 / 41), wide at 3: 40 / 36 (2: 27 / 35); q4_1 and q5_1 wide at
#     3: 38 / 34, 42 / 37 (2: 31 / 34, 30 / 36).
#   - q4_1 and q5_1 narrow at 5, measured again with session 23's layouts (session 24, call 1: --kernels dp4a mmq
#     --m 2 3 4 5 6 8): 52.4 / 35.4 and 49.2 / 44.6 (4: 32.3 / 37.7, 35.9 / 44.4; 8: 52.8 / 38.3, 49.9 / 49.2).
#   - Q3_K, Q8_0 and Q5_0 on the grouped CUDA layout (session 29, call 4: --kernels dp4a mmq --m 2 3 4 5 6 8): q3k
#     narrow at 2 38.5 / 36.7, wide at 2 41.8 / 34.8; q5_0 at 5 51.3 / 44.1 and 60.8 / 41.4 (4: 34.2 / 45.7, 37.6 /
#     43.3); q8_0 at 5 57.5 / 47.9 and 69.0 / 46.0 (4: 41.3 / 47.3, 39.2 / 45.4); q6k still at 2 (46.5 / 40.3, 39.4 /
#     39.1).
#   - After session 33's dp4a launch defaults (8 rows at two tokens for the K-quants, 4 rows and 128 registers for
#     the 32-element types; call 2: --kernels dp4a mmq --m 2 3 4 5 6 8 --codes): the K-quants' dp4a at two tokens
#     now beats the product for q6k (34.7 / 38.6 narrow, 34.9 / 37.0 wide), q3k (27.8 / 36.3, 28.5 / 33.2), q2k
#     narrow (27.8 / 29.8; wide even, 25.5 / 25.3) and q4k wide (26.6 / 28.6; narrow 26.7 / 25.0): those move to 3
#     (at 3 the product wins by 18-40 %); q5k stays at 2 (30.7 / 28.1, 32.5 / 31.2). q4_0 wide moves to 5 (3 and 4:
#     35.5 / 35.6, even; 5: 52.0 / 36.6), q4_1 wide to 5 (3: 34.2 / 33.8, 4: 34.2 / 34.7; 5: 49.5 / 35.9), q5_1
#     wide to 5 (4: 35.6 / 36.7) and q5_1 narrow to 9: its dp4a won at every count to 8 (8: 43.8 / 50.2). q4_0,
#     q4_1, q5_0 and q8_0 narrow and q5_0 and q8_0 wide stay at 5 (4 / 5: q4_0 30.1 / 36.5, 42.6 / 37.3; q8_0 38.0 /
#     42.3, 49.3 / 46.6).
#   - q2k wide to 3 once its two-token launches ran row by row (session 50, H100, --types q2k --kernels dp4a mmq --m 2
#     3 4 --codes; us dp4a / mmq on 28672x4096): 2: 23.23 / 27.43 (narrow 7.05 / 8.48, 5.04 / 5.85); 3: 37.60 / 27.62.
#
# MMQ_MIN_ROWS_REGISTERS, the register kernel alone (us, mmq / dp4a; --kernels mmq dp4a --codes --m 2 3 4 5 6 ...,
# benches/RESULTS.md sessions 9, 10, 13; the same shape sums):
#   - the K-quants (session 13, call 7: the min terms and the 16-element halves on the tensor cores, one row tile up
#     to 8 / 16 tokens): q4k at 2 28.4 / 34.1 and 27.9 / 33.9; q5k at 2 33.6 / 36.7 and 32.9 / 39.5; q6k at 3 48.3 /
#     55.3 and 52.3 / 61.8 (2: 48.1 / 47.3, 51.4 / 48.6); q2k narrow at 3 34.8 / 39.2 (2: 34.5 / 34.5, even), wide at
#     2 27.9 / 38.1; q3k narrow at 5 48.5 / 65.1 (3: 47.6 / 47.1, 4: 48.0 / 46.7), wide at 3 44.9 / 51.5 (2: 44.6 /
#     43.3).
#   - the 32-element types (sessions 9 and 10): wide, q4_1 at 5 56.8 / 69.3 (4: 54.9 / 38.8); q4_0, q5_1, q8_0 at
#     9 (q8_0 103.4 / 102.8, even); narrow, q4_0, q4_1, q5_1, q8_0 at 9 (q8_0 93.2 / 93.1, even; 10 rows over the
#     four shapes 194.2 / 202.6).
#   - q5_0 at 16 on both (9: 204.7 / 194.4 over the four shapes; 12 and 16 measured with an earlier kernel, 256.1 /
#     248.8 and 262.0 / 279.0).
# A token's bits depend on which kernel its batch takes (dp4a or the product, and for some types the product's staged
# kernel, which takes 16 warps there, or its register kernel: gguf_mmq.cu staged_warps), not on the other tokens
# within one.
MMQ_WIDE_FEATURES = 16384
MMQ_MIN_ROWS: dict[QT, tuple[int, int]] = {  # (narrow, wide)
    QT.Q4_K: (2, 3), QT.Q5_K: (2, 2), QT.Q6_K: (3, 3), QT.Q2_K: (3, 3), QT.Q3_K: (3, 3),
    QT.Q8_0: (5, 5), QT.Q4_0: (5, 5), QT.Q4_1: (5, 5), QT.Q5_1: (9, 5), QT.Q5_0: (5, 5),
}
MMQ_MIN_ROWS_REGISTERS: dict[QT, tuple[int, int]] = {
    QT.Q4_K: (2, 2), QT.Q5_K: (2, 2), QT.Q6_K: (3, 3), QT.Q2_K: (3, 2), QT.Q3_K: (5, 3),
    QT.Q8_0: (9, 9), QT.Q4_0: (9, 9), QT.Q4_1: (9, 5), QT.Q5_1: (9, 9), QT.Q5_0: (16, 16),
}


def staged_mmq_runs(qtype: QT, in_features: int) -> bool:
    """Whether the tensor-core product's staged kernel takes batches of a ``qtype`` weight with ``in_features``
    columns on the current CUDA device (a Hopper GPU, rows a whole number of 16-byte granules); False without CUDA
    kernels."""
    mod = native.module()
    if not (mod is not None and mod.built_with_cuda and torch.cuda.is_available()):
        return False
    return _staged_mmq_runs(int(qtype), in_features, torch.cuda.current_device())


@functools.cache
def _staged_mmq_runs(qtype: int, in_features: int, device: int) -> bool:
    return bool(native.loaded().cuda_gguf_mmq_staged_fits(qtype, 1, in_features))


def mmq_min_rows(qtype: QT, out_features: int, in_features: int) -> int | None:
    """The rows from which a CUDA decode batch of a ``qtype`` weight [out_features, in_features] takes the int8
    tensor-core product (None: the type has none): MMQ_MIN_ROWS where its staged kernel runs, else
    MMQ_MIN_ROWS_REGISTERS."""
    table = MMQ_MIN_ROWS if staged_mmq_runs(qtype, in_features) else MMQ_MIN_ROWS_REGISTERS
    narrow_wide = table.get(qtype)
    return None if narrow_wide is None else narrow_wide[out_features >= MMQ_WIDE_FEATURES]


@functools.cache
def mmq_enabled() -> bool:
    """False when ``CANDLE_VLLM_GGUF_MMQ=0`` (read once): decode batches then keep the dp4a passes and dequantize
    + cuBLAS, so benchmarks can A/B the tensor-core product."""
    return os.environ.get("CANDLE_VLLM_GGUF_MMQ", "1").strip() != "0"


def takes_tensor_cores(qtype: QT, rows: int, out_features: int, in_features: int) -> bool:
    """Whether a CUDA decode batch of ``rows`` rows of a ``qtype`` weight [out_features, in_features] takes the int8
    tensor-core product (where its operands allow it): from :func:`mmq_min_rows` to the product's maximum rows,
    unless switched off."""
    low = mmq_min_rows(qtype, out_features, in_features)
    return low is not None and low <= rows <= native.loaded().cuda_gguf_mmq_max_m and mmq_enabled()


def takes_mmq(x2: torch.Tensor, flat: torch.Tensor, qtype: QT, out_features: int, in_features: int) -> bool:
    """Whether the decode batch x2 [rows, in_features] of this weight takes the int8 tensor-core product: its size
    (:func:`takes_tensor_cores`) and its operands (``cuda_gguf.mmq_supported``)."""
    return takes_tensor_cores(qtype, x2.shape[0], out_features, in_features) and cuda_gguf.mmq_supported(
        x2, flat, qtype, out_features, in_features
    )


def q8_max_rows(qtype: QT, in_features: int) -> int:
    """The most rows a CUDA decode batch of a ``qtype`` weight with ``in_features`` columns multiplies on int8
    codes (the dp4a GEMV and its passes, or the tensor-core product): its producers may then write the codes. Ask
    it for weights on a CUDA device (a build without CUDA kernels has no tensor-core product)."""
    mod = native.module()
    mmq = (
        mmq_enabled()
        and in_features % 256 == 0
        and mod is not None
        and mod.built_with_cuda
        and mod.cuda_gguf_mmq_supported(int(qtype))
    )
    return mod.cuda_gguf_mmq_max_m if mmq and mod is not None else GEMV_PASSES_MAX_ROWS


def q8_group(qtype: QT, rows: int, out_features: int, in_features: int) -> int:
    """The scale group of the int8 codes a CUDA decode batch of ``rows`` rows of this weight multiplies: the
    tensor-core product's (``cuda_gguf.x_group``: 256 for the K-quants) where the batch's size takes it, else the
    dp4a GEMV's 32; 0 past :func:`q8_max_rows`. A producer asked for these codes writes what the kernel would. Where
    the operands then refuse the product (:func:`takes_mmq`: alignment, layout), the dp4a GEMV reads the 256-value
    codes: correctly (every XBlock holds its scale), with the rounding of the per-256 codes."""
    most = q8_max_rows(qtype, in_features)
    if not 1 <= rows <= most:
        return 0
    if most > GEMV_PASSES_MAX_ROWS and takes_tensor_cores(qtype, rows, out_features, in_features):
        return cuda_gguf.x_group(qtype)
    return BLOCK


def _cuda_quant_matmul(
    x: torch.Tensor, flat: torch.Tensor, qtype: QT, out_features: int, in_features: int, q8: Q8Activation | None
) -> torch.Tensor:
    """Decode batches: from ``mmq_min_rows(qtype, out_features, in_features)`` to 32 rows of f16/bf16 the int8
    tensor-core product where the type has one; else up to 8 rows the fused dp4a GEMV and up to 16 rows that GEMV in
    passes of 8 rows, each reading the quantized bytes once. Within each kernel a row's arithmetic does not depend on
    the other rows (and the passes are the 8-row GEMV's), so results are batch invariant for batches that take the
    same kernel. ``q8``'s codes (rows as x's) go to the int8 kernels. Larger batches (prefill): W dequantized into a
    scratch tensor from torch's allocator, then one cuBLAS GEMM."""
    x2 = x.reshape(-1, in_features).contiguous()
    q8 = Q8Activation(x2, q8.xq, q8.xb, q8.group) if q8 is not None else None
    rows, per_pass = x2.shape[0], native.loaded().cuda_gguf_gemv_max_m
    if takes_mmq(x2, flat, qtype, out_features, in_features):
        y = cuda_gguf.mmq(q8 or x2, flat, qtype, out_features, in_features)
    elif cuda_gguf.gemv_supported(x2, flat, qtype, out_features, in_features):
        y = cuda_gguf.gemv(q8 or x2, flat, qtype, out_features, in_features)
    elif rows <= GEMV_PASSES_MAX_ROWS and cuda_gguf.gemv_supported(x2[:per_pass], flat, qtype, out_features,
                                                                    in_features):
        starts = range(0, rows, per_pass)
        parts = [q8.row_slice(i, i + per_pass) for i in starts] if q8 else [x2[i : i + per_pass] for i in starts]
        y = torch.cat([cuda_gguf.gemv(p, flat, qtype, out_features, in_features) for p in parts])
    else:
        w = cuda_gguf.dequantize(flat, qtype, out_features, in_features, x.dtype)
        y = torch.matmul(x2, w.t())
    return y.view(*x.shape[:-1], out_features)
