"""The wgmma decode GEMM for 17..64 tokens (native/cuda/wide_gemm.cu): checks, split-K choice, pointer passing.

Batches above the skinny GEMM's 16 rows went to cuBLAS, which reads the 8B decode weights at 64-90 % of HBM
bandwidth at 64 tokens; this kernel streams each weight byte once through a warpgroup's shared-memory pipeline.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import (
    HALF_DTYPES,
    _aligned,
    _device_index,
    _split_counters,
    available,
    sm_count,
)

ENV = "CANDLE_VLLM_WIDE_GEMM"
_TILE_ROWS = 64
_K_STAGE = 64
_CTAS_PER_SM = 3  # 65 KB of shared memory each (4 stages of a 64x64 weight tile and a 64x64 token tile)


@functools.cache
def _device_ok(device_index: int) -> bool:
    return bool(native.module().cuda_wide_gemm_available(device_index))


def wide_gemm_enabled() -> bool:
    """``CANDLE_VLLM_WIDE_GEMM=0`` sends 17..64-row batches back to cuBLAS (an A/B switch for benchmarks)."""
    return os.environ.get(ENV, "1") != "0"


def wide_gemm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when ``x @ weight.T`` can run on the wgmma kernel: x [M<=64, K] and weight [N, K] contiguous,
    16-byte aligned f16/bf16 of one dtype on a Hopper GPU with an sm_90a build, K % 8 == 0."""
    return (
        available(x.device)
        and x.dim() == 2
        and weight.dim() == 2
        and x.dtype in HALF_DTYPES
        and weight.dtype == x.dtype
        and weight.device == x.device
        and 1 <= x.shape[0] <= native.module().cuda_wide_max_m
        and x.shape[1] == weight.shape[1]
        and x.shape[1] % 8 == 0
        and x.is_contiguous()
        and weight.is_contiguous()
        and _aligned(x, weight)
        and _device_ok(_device_index(x.device))
    )


def wide_gemm_splits(n: int, k: int, sms: int) -> int:
    """K splits for an [N, K] weight: enough for the 64-row tiles to fill every SM's three CTA slots, keeping at
    least four 64-wide k stages per split (a first guess, to be set from `bench_kernels.py --only wide`)."""
    tiles = math.ceil(n / _TILE_ROWS)
    stages = math.ceil(k / _K_STAGE)
    return max(1, min(math.ceil(_CTAS_PER_SM * sms / tiles), stages // 4))


def wide_gemm(x: torch.Tensor, weight: torch.Tensor, splits: int | None = None, silu_mul: bool = False) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight [N, K].T for M <= 64 on wgmma; ``silu_mul`` as in ``cuda.skinny_gemm`` (an
    interleaved gate/up weight, y [M, N/2] = silu(gate) * up). ``splits`` overrides :func:`wide_gemm_splits`."""
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
    dev = _device_index(x.device)
    if splits is None:
        splits = wide_gemm_splits(n, k, sm_count(dev))
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else None
    counters = _split_counters(dev).data_ptr() if splits > 1 else 0
    y = torch.empty(m, n // 2 if silu_mul else n, dtype=x.dtype, device=x.device)
    native.module().cuda_wide_gemm(
        y.data_ptr(), x.data_ptr(), weight.data_ptr(), 0 if partials is None else partials.data_ptr(), counters, m, n,
        k, splits, silu_mul, native.dtype_code(x), native.stream(x.device),
    )
    return y
