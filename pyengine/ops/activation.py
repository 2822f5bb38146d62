"""Gated activations of the MLP block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops import cuda


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused gate/up projection: ``x = [gate, up]`` on the last dim -> ``silu(gate) * up``.

    The gate and up projections are computed as one matmul, so the activation takes their concatenation.
    On CUDA the native kernel runs when it supports the tensor (one read, one write, no temporaries).
    """
    if x.device.type == "cuda" and (out := cuda.silu_and_mul(x)) is not None:
        return out
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
