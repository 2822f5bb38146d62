"""The Hopper decode GEMM for 17..64 tokens (native/cuda/wide_gemm.cu): checks, the dispatch rule, pointer passing.

Batches above the skinny GEMM's 16 rows go to cuBLASLt, except on weights of several nearly full waves of 256-row
tiles (the LM head): there this TMA + wgmma kernel, one 256-row CTA per SM, streams the weight at 97-100 % of the
copy ceiling where cuBLASLt reaches 88-94 % (H200, 128256x4096: 258 vs 285 us at 64 rows, 250 vs 266 at 32).
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
CTA_ROWS = 256  # weight rows per CTA (kWideRows in native/cuda/wide_gemm.h)


@functools.cache
def _device_ok(device_index: int) -> bool:
    return bool(native.loaded().cuda_wide_gemm_available(device_index))


def wide_gemm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` can run on the wide kernel: x [M<=64, K] and weight [N, K] contiguous,
    16-byte aligned f16/bf16 of one dtype on a Hopper GPU with an sm_90a build, K % 8 == 0."""
    return (
        available(x.device)
        and gemm_operands_ok(x, weight, native.loaded().cuda_wide_max_m)
        and _device_ok(_device_index(x.device))
    )


def fills_waves(n: int, sms: int) -> bool:
    """Whether N rows make more 256-row tiles than SMs and fill their waves to 90 % on average: the kernel only
    outruns cuBLASLt while every SM streams (a 1.7-wave grid idles a third of the GPU in its last wave)."""
    tiles = math.ceil(n / CTA_ROWS)
    return tiles > sms and 10 * tiles >= 9 * math.ceil(tiles / sms) * sms


def wide_gemm_preferred(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether a 17..64-row batch should take the wide kernel instead of cuBLASLt: it can run it and the weight
    :func:`fills_waves` (see the module docstring). ``CANDLE_VLLM_WIDE_GEMM=0`` keeps cuBLASLt (an A/B switch for
    benchmarks)."""
    return (
        os.environ.get(ENV, "1") != "0"
        and wide_gemm_supported(x, weight)
        and fills_waves(weight.shape[0], sm_count(_device_index(x.device)))
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
    native.loaded().cuda_wide_gemm(
        y.data_ptr(), x.data_ptr(), weight.data_ptr(), m, n, k, silu_mul, native.dtype_code(x), native.stream(x.device)
    )
    return y
