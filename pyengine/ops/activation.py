"""Gated activations of the MLP block."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up projection: ``x = [gate, up]`` on the last dim -> ``silu(gate) * up``.

    The gate and up projections are computed as one matmul, so the activation takes their concatenation.
    """
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
