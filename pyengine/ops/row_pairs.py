"""Weight row layouts that put both members of feature pairs next to each other, so the kernel that computes
them can combine them in its epilogue: gate with up (SwiGLU) and a head's two halves (neox RoPE).

The pairs come in groups of ``group`` rows: 8 for the bf16 skinny GEMM (one 16-row tile holds 8 pairs), 1 for
the GGUF dp4a GEMV (a CTA owns an even number of consecutive rows, so each holds whole adjacent pairs)."""

from __future__ import annotations

import torch

PAIR_GROUPS = (1, 8)  # the groups the CUDA RoPE kernels read in place (ops.cuda_rotary)


def interleave_halves(weight: torch.Tensor, block: int, group: int = 8) -> torch.Tensor:
    """``weight`` [R, K] read as consecutive blocks of ``block`` rows, each [first half; second half], with every
    block's rows regrouped as first-half rows gj..gj+g-1, then second-half rows gj..gj+g-1 (g = ``group``,
    j = 0 .. block/(2g) - 1). Rows are moved whole, so any row format works (dense, or GGUF block bytes)."""
    rows, k = weight.shape[0], weight.shape[1:]
    if group < 1 or block % (2 * group) or rows % block:
        raise ValueError(f"interleave_halves: needs blocks of {2 * group}k rows dividing {rows}, got {block}")
    return weight.reshape(rows // block, 2, block // (2 * group), group, *k).transpose(1, 2).reshape(
        weight.shape).contiguous()


def deinterleave_halves(y: torch.Tensor, block: int, group: int = 8) -> torch.Tensor:
    """The standard layout of the last dim of an :func:`interleave_halves` weight's output (same ``group``)."""
    n = y.shape[-1]
    pairs = y.reshape(*y.shape[:-1], n // block, block // (2 * group), 2, group)
    return pairs.transpose(-3, -2).reshape(y.shape)
