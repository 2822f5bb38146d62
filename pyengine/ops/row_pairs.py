"""Weight row layouts that put both members of 8 feature pairs into one 16-row tile of the skinny GEMM, so its
epilogue can combine them: gate with up (SwiGLU) and a head's two halves (neox RoPE)."""

from __future__ import annotations

import torch


def interleave_halves(weight: torch.Tensor, block: int) -> torch.Tensor:
    """``weight`` [R, K] read as consecutive blocks of ``block`` rows, each [first half; second half], with every
    block's rows regrouped as first-half 8j..8j+7, second-half 8j..8j+7 (j = 0 .. block/16 - 1)."""
    rows, k = weight.shape
    if block % 16 or rows % block:
        raise ValueError(f"interleave_halves: needs blocks of 16k rows dividing {rows}, got {block}")
    return weight.view(rows // block, 2, block // 16, 8, k).transpose(1, 2).reshape(rows, k).contiguous()


def deinterleave_halves(y: torch.Tensor, block: int) -> torch.Tensor:
    """The standard layout of the last dim of an :func:`interleave_halves` weight's output."""
    n = y.shape[-1]
    pairs = y.reshape(*y.shape[:-1], n // block, block // 16, 2, 8)
    return pairs.transpose(-3, -2).reshape(y.shape)
