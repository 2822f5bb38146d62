"""The Hopper decode GEMM for 17..64 tokens (native/cuda/wide_gemm.cu): checks, the dispatch rule, pointer passing.

Batches above the skinny GEMM's 16 rows go to cuBLASLt, except on weights with more 256-row tiles than the GPU has
SMs (the LM head): there this TMA + wgmma kernel, one 256-row CTA per SM in several full waves, streams the weight
at ~95 % of the copy ceiling where cuBLASLt reaches 87-94 % (H200, 128256x4096 at 64 rows: 263 vs 270-286 us).
On narrower weights its one-wave grids (split-K or not) measured slower than cuBLASLt, so they are not sent here
(benches/RESULTS.md, 2026-12-02, session 16).
"""

from __future__ import annotations

import functools
import math
import os

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import _device_index, available, gemm_operands_ok, sm_count

ENV = "CANDLE_VLLM_WIDE_GEMM"


@functools.cache
def _device_ok(device_index: int) -> bool:
    return bool(native.module().cuda_wide_gemm_available(device_index))


def wide_gemm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` can run on the wide kernel: x [M<=64, K] and weight [N, K] contiguous,
    16-byte aligned f16/bf16 of one dtype on a Hopper GPU with an sm_90a build, K % 8 == 0."""
    return (
        available(x.device)
        and gemm_operands_ok(x, weight, native.module().cuda_wide_max_m)
        and _device_ok(_device_index(x.device))
    )


def wide_gemm_preferred(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a 17..64-row batch should take the wide kernel instead of cuBLASLt: it can run it and the weight has
    more 256-row tiles than SMs (see the module docstring). ``CANDLE_VLLM_WIDE_GEMM=0`` keeps cuBLASLt (an A/B
    switch for benchmarks)."""
    return (
        os.environ.get(ENV, "1") != "0"
        and wide_gemm_supported(x, weight)
        and math.ceil(weight.shape[0] / native.module().cuda_wide_rows) > sm_count(_device_index(x.device))
    )


def wide_gemm(x: torch.Tensor, weight: torch.Tensor, *, silu_mul: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K].T for M <= 64 on the Hopper kernel; ``silu_mul`` as in
    ``cuda.skinny_gemm`` (an interleaved gate/up weight, y [M, N/2] = silu(gate) * up)."""
    if not wide_gemm_supported(x, weight):
        raise ValueError(
            "wide_gemm needs x [M<=64, K] and weight [N, K] contiguous f16/bf16 CUDA tensors of one dtype, 16-byte "
            f"aligned, K % 8 == 0, on a Hopper GPU (sm_90a build); got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight.shape)} {weight.dtype}"
        )
    m, k = x.shape
    n = weight.shape[0]
    if silu_mul and n % 16:
        raise ValueError(f"wide_gemm: silu_mul needs an interleaved gate/up weight of 16k rows, got {n}")
    y = torch.empty(m, n // 2 if silu_mul else n, dtype=x.dtype, device=x.device)
    native.module().cuda_wide_gemm(
        y.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k, silu_mul, native.dtype_code(x), native.stream(x.device)
    )
    return y
