"""The decode GEMM over weights stored [K, N] (native/cuda/skinny_gemm_kn.cu): checks, launch rules, pointers.

Why a second layout: cuBLASLt multiplies 17-64 tokens by a weight stored [K, N] (``x @ W``) 1-5 % faster than by
the same weight stored [N, K] (session 28), and keeping the gate/up projection [K, N] made batch-64 decode 1.0 %
faster in the model (session 30). A weight is kept in one layout only, so its 1-16-token batches need this kernel,
which reads [K, N] at the speed ``cuda.skinny_gemm`` reads [N, K]. The launch rules below are the best settings of
session 30's probe kernel on the H200 (benches/RESULTS.md; ``benches/bench_skinny_kn.py`` sweeps this kernel's):
strips of 64 columns; one split with 4 warps and 2 slabs per stage where the strips fill two CTAs per SM (gate/up:
this kernel's sweep in session 33, 56.5 / 57.0 / 60.9 us at 1 / 4 / 16 tokens against 57.8 / 58.4 at 4 slabs and
skinny_gemm's 56.7 / 56.7 / 62.6), else 8 warps, the next slab loaded ahead, and as many splits as one wave holds
(4096x14336: 29.8 us against 28.2).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.cuda import (
    _COUNTER_SLOTS,
    _device_index,
    _split_counters,
    available,
    gemm_operands_ok,
    sm_count,
)

STRIP = 64  # weight columns per CTA (kSkinnyKnStrip)
SLAB = 16  # k rows per slab (kSkinnyKnSlab)


def skinny_gemm_kn_supported(x: torch.Tensor, weight_kn: torch.Tensor) -> bool:
    """True when ``x @ weight_kn`` can run on the kernel: x [1..16, K] and weight [K, N] contiguous, 16-byte aligned
    f16/bf16 of one dtype on one CUDA device, K % 16 == 0 and N % 64 == 0."""
    return (
        available(x.device)
        and gemm_operands_ok(x, weight_kn, native.loaded().cuda_skinny_kn_max_m, k_dim=0)
        and x.shape[1] % SLAB == 0
        and weight_kn.shape[1] % STRIP == 0
    )


@functools.cache
def ctas_per_sm(
    device_index: int, many_tokens: bool, warps: int, stage_slabs: int, silu_mul: bool, dtype: torch.dtype
) -> int:
    """CTAs of one launch kind an SM holds at once (its registers decide: ptxas sm_90a, 8 warps and one slab per
    stage, 64 for up to 8 tokens, 86 for 9-16), from the CUDA occupancy calculator."""
    with torch.cuda.device(device_index):
        return int(native.loaded().cuda_skinny_gemm_kn_ctas_per_sm(
            16 if many_tokens else 1, warps, stage_slabs, silu_mul, native.DTYPE_CODES[dtype]))


def skinny_gemm_kn_launch(n: int, k: int, sms: int, resident: Callable[[int, int], int]) -> tuple[int, int, int]:
    """(splits, warps, slabs per stage) for a [K, N] weight at any token count (see the module docstring), with
    ``resident(warps, stage_slabs)`` the CTAs an SM holds at the call's token count: the grid is sized to one wave, since call 7 (session 30)
    ran 576 CTAs where 528 fit (9 splits of 4096x14336's 64 strips) at 36.8 us against the probe's 29.8 with 512,
    and 16 tokens at 4 slabs per stage (3 CTAs per SM: gate/up's 448 strips in 1.1 waves) at 91.3 us against the
    probe's 60.1 with 2."""
    strips = n // STRIP
    warps, stage = (4, 2) if strips >= 2 * sms else (8, 1)
    capacity = resident(warps, stage) * sms
    splits = max(1, min(16, capacity // strips, k // SLAB // (warps * stage)))
    per_split = math.ceil(k // SLAB / splits)
    return math.ceil(k // SLAB / per_split), warps, stage


def skinny_gemm_kn(
    x: torch.Tensor,
    weight_kn: torch.Tensor,
    *,
    silu_mul: bool = False,
    splits: int | None = None,
    warps: int | None = None,
    stage_slabs: int | None = None,
) -> torch.Tensor:
    """y [M, N] = x [M, K] @ weight_kn [K, N] for decode-sized M (<= 16), reading the weight once.

    ``splits``, ``warps`` (4 or 8) and ``stage_slabs`` (1, 2 or 4) override :func:`skinny_gemm_kn_launch`
    (benchmarks sweep them); the result depends on them only through the f32 summation order. ``silu_mul``: the
    weight is a gate/up projection whose columns alternate in groups of 8 (``interleave_gate_up`` of the [N, K]
    weight, transposed) and the result is y [M, N / 2] = silu(gate) * up, rounded as the projection followed by
    ``silu_and_mul`` rounds it.
    """
    if not skinny_gemm_kn_supported(x, weight_kn):
        raise ValueError(
            "skinny_gemm_kn needs x [M<=16, K] and weight [K, N] contiguous f16/bf16 CUDA tensors of one dtype, "
            f"16-byte aligned, K % {SLAB} == 0, N % {STRIP} == 0; got x {tuple(x.shape)} {x.dtype}, weight "
            f"{tuple(weight_kn.shape)} {weight_kn.dtype}"
        )
    m, k = x.shape
    n = weight_kn.shape[1]
    dev = _device_index(x.device)
    def resident(w: int, st: int) -> int:
        return ctas_per_sm(dev, m > 8, w, st, silu_mul, x.dtype)

    auto = skinny_gemm_kn_launch(n, k, sm_count(dev), resident)
    splits = auto[0] if splits is None else splits
    warps = auto[1] if warps is None else warps
    stage_slabs = auto[2] if stage_slabs is None else stage_slabs
    if splits > 1 and n // STRIP > _COUNTER_SLOTS:
        raise ValueError(f"skinny_gemm_kn: split-K supports N up to {_COUNTER_SLOTS * STRIP}; use splits=1")
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else None
    y = torch.empty(m, n // 2 if silu_mul else n, dtype=x.dtype, device=x.device)
    native.loaded().cuda_skinny_gemm_kn(
        y.data_ptr(), x.data_ptr(), weight_kn.data_ptr(), 0 if partials is None else partials.data_ptr(),
        _split_counters(dev).data_ptr() if splits > 1 else 0, m, n, k, splits, warps, stage_slabs, silu_mul,
        native.dtype_code(x), native.stream(x.device),
    )
    return y
