"""In-situ quantization (``--isq``): dense checkpoint weights become GGUF blocks while the model loads.

Serving an unquantized checkpoint quantized in place gives GGUF's memory footprint and kernels without a
conversion step. The blocks are byte-for-byte llama.cpp's reference quantizers (``quantize_row_*_ref`` in
ggml-quants.c, what ``llama-quantize`` writes without an importance matrix) and, for Q4_0/Q4_1/Q5_0/Q5_1/Q8_0,
the ``gguf`` package's ``gguf.quants.quantize`` (it implements no K-quant). Rounding rules:

- Q8_0: ``d = absmax / 127`` per 32 values, ``q = round(x / d)`` with halves away from zero.
- Q4_0/Q5_0: ``d = m / -8`` (``/ -16``) where ``m`` is the value of largest magnitude, ``q = trunc(x/d + 8.5)``
  (``+ 16.5``), clamped to the code range; Q4_1/Q5_1: ``d = (max - min) / 15`` (``/ 31``), ``m = min``,
  ``q = trunc((x - min)/d + 0.5)``.
- K-quants: per 16- (Q2_K, Q3_K, Q6_K) or 32-value (Q4_K, Q5_K) sub-block, ggml's scale searches
  (``make_qkx2_quants`` for Q2_K/Q4_K/Q5_K, ``make_q3_quants`` for Q3_K, ``make_qx_quants`` for Q6_K), the
  sub-block scales then quantized to 4/6/8 bits against an f16 super-block scale, and every value requantized
  against its stored scale with round-half-to-even (ggml's ``nearest_int``).

All scales are stored as f16 with round-to-nearest-even; a weight too large for them (inf scales) is refused. An
all-zero block whose first value is -0.0 keeps llama.cpp's scale -0.0 (the ``gguf`` package writes +0.0; both
decode to zeros). CPU: a native kernel (OpenMP over rows); CUDA: one
thread per block running the same C++ code with IEEE-rounded intrinsics, so both give the same bytes (f32
subnormal intermediates, below 1.2e-38, flush to zero on the GPU).
"""

from __future__ import annotations

import logging
import re

import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.quant import block_size, row_bytes
from candle_vllm.pyengine.quant.gguf import GGUFWeight

log = logging.getLogger(__name__)

ISQ_QTYPES: dict[str, QT] = {
    "q4_0": QT.Q4_0,
    "q4_1": QT.Q4_1,
    "q5_0": QT.Q5_0,
    "q5_1": QT.Q5_1,
    "q8_0": QT.Q8_0,
    "q2k": QT.Q2_K,
    "q3k": QT.Q3_K,
    "q4k": QT.Q4_K,
    "q5k": QT.Q5_K,
    "q6k": QT.Q6_K,
}

# What llama.cpp's quantizer substitutes when a row is not a whole number of 256-value super-blocks
# (llama_tensor_get_type); Q2_K/Q3_K fall back to IQ4_NL there, which has no kernels here, so Q4_0.
K_FALLBACK: dict[QT, QT] = {QT.Q2_K: QT.Q4_0, QT.Q3_K: QT.Q4_0, QT.Q4_K: QT.Q5_0, QT.Q5_K: QT.Q5_1, QT.Q6_K: QT.Q8_0}

# Decoder linear weights (q/k/v/o, gate/up/down, ...): 2-D weights under model.layers. Embeddings and the LM
# head stay in the model dtype (their rows are gathered or produce the logits; llama.cpp keeps them wider too).
_TARGET = re.compile(r"model\.layers\.\d+\..+\.weight$")
# Byte offsets of each block's f16 scales (d, and dmin / m where present; ggml-common.h layouts): a finite weight
# too large for them (|w| ~ 1e6 for q4_0, 1e8 for q6k) would quantize to inf scales and serve NaN.
_F16_SCALES = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}


def resolve_qtype(qtype: QT | str) -> QT:
    """The GGML type of an ``--isq`` name (``q4k``) or type; a ValueError names the choices otherwise."""
    if isinstance(qtype, str):
        if qtype not in ISQ_QTYPES:
            raise ValueError(f"unknown ISQ type {qtype!r} (choose from {', '.join(ISQ_QTYPES)})")
        return ISQ_QTYPES[qtype]
    if qtype not in ISQ_QTYPES.values():
        raise ValueError(f"ISQ does not produce {QT(qtype).name} (types: {', '.join(ISQ_QTYPES)})")
    return qtype


def quantize(weight: torch.Tensor, qtype: QT | str) -> torch.Tensor:
    """GGUF blocks of ``weight`` [N, K] (f32/f16/bf16, CPU or CUDA): uint8 [N, row_bytes] on the same device.

    K must be a whole number of blocks (32 values, 256 for K-quants) and every value finite. A CUDA tensor is
    quantized on its GPU when the native module has CUDA kernels, else on the CPU and copied back.
    """
    t = resolve_qtype(qtype)
    if weight.dim() != 2 or weight.dtype not in native.FLOAT_DTYPES:
        raise ValueError(f"ISQ needs a 2-D f32/f16/bf16 weight, got {weight.dtype} of shape {list(weight.shape)}")
    rows, cols = weight.shape
    nbytes = row_bytes(t, cols)  # raises for partial blocks
    if not bool(torch.isfinite(weight).all()):
        raise ValueError("ISQ input holds NaN or infinite values (a corrupt checkpoint?)")
    x = weight.contiguous()
    out = torch.empty((rows, nbytes), dtype=torch.uint8, device=x.device)
    mod = native.module()
    if x.device.type == "cuda" and native.available(x.device):
        with torch.cuda.device(x.device):
            native.loaded().cuda_isq_quantize(
                native.ptr(out), native.ptr(x), rows, cols, native.dtype_code(x), int(t), native.stream(x.device)
            )
        return _check_scales(out, t, x)
    if mod is None:
        raise RuntimeError("ISQ needs the native module (candle_vllm._native), which is not installed")
    if x.device.type != "cpu":
        return quantize(x.cpu(), t).to(x.device)
    mod.cpu_isq_quantize(native.ptr(out), native.ptr(x), rows, cols, native.dtype_code(x), int(t))
    return _check_scales(out, t, x)


def _check_scales(blocks: torch.Tensor, qtype: QT, weight: torch.Tensor) -> torch.Tensor:
    """``blocks``, once every f16 scale in them is finite; else a ValueError naming the magnitude."""
    size = row_bytes(qtype, block_size(qtype))
    flat = blocks.view(-1, size)
    for offset in _F16_SCALES[qtype]:
        if not bool(torch.isfinite(flat[:, offset : offset + 2].contiguous().view(torch.float16)).all()):
            raise ValueError(f"the weight's magnitude (max |w| = {float(weight.abs().max()):.3g}) overflows the f16 "
                             f"block scales of {qtype.name}; keep this model unquantized (drop --isq)")
    return blocks


def effective_qtype(qtype: QT, cols: int) -> QT | None:
    """The type a row of ``cols`` values gets: ``qtype``, llama.cpp's fallback for K-quants when rows are not
    whole super-blocks, or None (stay dense) when they are not even whole 32-value blocks."""
    if cols % block_size(qtype) == 0:
        return qtype
    fallback = K_FALLBACK.get(qtype)
    return fallback if fallback is not None and cols % block_size(fallback) == 0 else None


def is_target(name: str, ndim: int) -> bool:
    """Whether ``--isq`` quantizes the checkpoint tensor ``name`` of ``ndim`` dimensions (a decoder layer's
    2-D weight)."""
    return ndim == 2 and _TARGET.match(name) is not None


def isq_weight(name: str, weight: torch.Tensor, qtype: QT, device: torch.device) -> torch.Tensor | GGUFWeight:
    """What the loader hands the model for ``name``: GGUF blocks made on ``device`` for decoder linear weights,
    ``weight`` unchanged otherwise (or when its rows are not whole blocks, with a warning)."""
    if not is_target(name, weight.dim()):
        return weight
    t = effective_qtype(qtype, weight.shape[1])
    if t is None:
        log.warning("--isq: %s has rows of %d values (not whole blocks); kept unquantized", name, weight.shape[1])
        return weight
    if t != qtype:
        log.warning("--isq: %s has rows of %d values (not whole %s super-blocks); quantized to %s as llama.cpp does",
                    name, weight.shape[1], qtype.name, t.name)
    return GGUFWeight(quantize(weight.to(device), t), t, (int(weight.shape[0]), int(weight.shape[1])))
