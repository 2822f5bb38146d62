"""Activations handed to a GGUF linear already quantized to int8 (the producer fusion of the dp4a GEMV).

Why: the dp4a GEMV rounds its input to int8 codes per 32 values before the dot products, a kernel launch of its
own on the decode chain. When the input comes from a kernel we own (the RMSNorms before qkv and gate_up, the
SiLU-and-mul before down), that kernel already holds each value in registers as it writes it, so it also writes
the codes (``native/cuda/q8_activation.cuh``: the same bytes the GEMV's quantizer would write) and the GEMV skips
its quantizer. The dense output is always kept too: a consumer that cannot use the codes falls back to it.
A consumer says which codes it takes: one scale per 32 values (the dp4a GEMV, the 32-element types' tensor-core
product) or per 256 (the K-quants' tensor-core product, whose sums then stay integer over a whole block).
``CANDLE_VLLM_Q8_FUSION=0`` (read once) turns the fusion off, so benchmarks can A/B it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

from candle_vllm.pyengine.ops import native

BLOCK = 32  # values per code block


@dataclass(frozen=True, slots=True)
class Q8Activation:
    """A dense activation ``x`` [..., K] with its int8 codes ``xq`` [rows, K] and blocks ``xb`` [rows, K / 32 * 8]
    (uint8 bytes of the native 8-byte XBlocks), rows = x.numel() / K, all on one CUDA device, row-major; ``group``
    values share one scale (32, or 256: every XBlock of a 256-value run then holds the same scale)."""

    x: torch.Tensor
    xq: torch.Tensor
    xb: torch.Tensor
    group: int

    @property
    def rows(self) -> int:
        return self.xq.shape[0]

    def row_slice(self, start: int, stop: int) -> Q8Activation:
        """Rows [start, stop) of a 2-D activation (the GEMV's 8-row passes); views, no copies."""
        return Q8Activation(self.x[start:stop], self.xq[start:stop], self.xb[start:stop], self.group)


def dense(x: torch.Tensor | Q8Activation) -> torch.Tensor:
    """The dense tensor of an activation, quantized or not (for consumers that only take dense inputs)."""
    return x.x if isinstance(x, Q8Activation) else x


@functools.cache
def fusion_enabled() -> bool:
    """False when ``CANDLE_VLLM_Q8_FUSION=0``: GGUF linears then never ask their producers for codes."""
    return os.environ.get("CANDLE_VLLM_Q8_FUSION", "1").strip() != "0"


GROUPS = (BLOCK, 256)  # the scale groups the kernels take: per 32 values, or per 256 (the K-quants on tensor cores)


def check_group(q8: int) -> None:
    """A producer's ``q8`` request must be 0 (no codes) or one of :data:`GROUPS`: anything else (a bool, another
    size) is refused, never silently ignored."""
    if isinstance(q8, bool) or q8 not in (0, *GROUPS):
        raise ValueError(f"q8 must be 0 (no codes) or a scale group of {' or '.join(map(str, GROUPS))} values, got {q8!r}")


def producer_supported(out: torch.Tensor, group: int, *inputs: torch.Tensor) -> bool:
    """Whether a native producer can write codes of ``group`` (32 or 256) values per scale for ``out`` (f16/bf16
    on a CUDA device with the kernels, last dim a multiple of the group, every tensor contiguous and 16-byte
    aligned)."""
    return (
        group in GROUPS
        and out.device.type == "cuda"
        and native.available(out.device)
        and out.dtype in (torch.float16, torch.bfloat16)
        and out.shape[-1] % group == 0
        and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (out, *inputs))
    )


def codes_for(x: torch.Tensor, group: int) -> Q8Activation:
    """Uninitialised code buffers for ``x`` with ``group`` values per scale (from torch's allocator: CUDA-graph
    capturable), for a producer to fill as it writes x."""
    k = x.shape[-1]
    rows = x.numel() // k
    xq = torch.empty(rows, k, dtype=torch.int8, device=x.device)
    xb = torch.empty(rows, k // BLOCK * native.loaded().cuda_gguf_xblock_bytes, dtype=torch.uint8, device=x.device)
    return Q8Activation(x, xq, xb, group)
