"""Gated activations of the MLP block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.ops.q8_activation import Q8Activation


def silu_and_mul(x: torch.Tensor, *, q8: bool = False) -> torch.Tensor | Q8Activation:
    """SwiGLU on a fused gate/up projection: ``x = [gate, up]`` on the last dim -> ``silu(gate) * up``.

    The gate and up projections are computed as one matmul, so the activation takes their concatenation.
    On CUDA the native kernel runs when it supports the tensor (one read, one write, no temporaries); with
    ``q8=True`` (for a GGUF linear that takes int8 activations) it also writes the output's int8 codes and
    returns a :class:`Q8Activation` where it can, else the plain tensor.
    """
    if x.device.type == "cuda" and (out := cuda.silu_and_mul(x, q8=q8)) is not None:
        return out
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
