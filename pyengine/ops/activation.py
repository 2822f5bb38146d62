"""Gated activations of the MLP block."""

from __future__ import annotations

from typing import Literal, overload

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation, check_group
from candle_vllm.pyengine.ops.row_pairs import deinterleave_halves, interleave_halves


@overload
def silu_and_mul(x: torch.Tensor, *, q8: Literal[0] = 0) -> torch.Tensor: ...
@overload
def silu_and_mul(x: torch.Tensor, *, q8: int) -> torch.Tensor | Q8Activation: ...
def silu_and_mul(x: torch.Tensor, *, q8: int = 0) -> torch.Tensor | Q8Activation:
    """SwiGLU on a fused gate/up projection: ``x = [gate, up]`` on the last dim -> ``silu(gate) * up``.

    The gate and up projections are computed as one matmul, so the activation takes their concatenation.
    On CUDA the native kernel runs when it supports the tensor (one read, one write, no temporaries); with
    ``q8`` (0, or the scale group a GGUF linear that takes int8 activations asks for) it also writes the output's
    int8 codes and returns a :class:`Q8Activation` where it can, else the plain tensor.
    """
    check_group(q8)
    if x.device.type == "cuda" and (out := cuda.silu_and_mul(x, q8=q8)) is not None:
        return out
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def interleave_gate_up(weight: torch.Tensor) -> torch.Tensor:
    """A fused gate/up weight [2I, K] (gate rows, then up rows) with its rows regrouped as gate 8j..8j+7, up
    8j..8j+7 for j = 0 .. I/8 - 1 (I % 8 == 0): one 16-row tile of the skinny GEMM then holds both factors of 8
    features, so its epilogue can apply the SiLU (``cuda.skinny_gemm(..., silu_mul=True)``)."""
    return interleave_halves(weight, weight.shape[0])


def silu_and_mul_interleaved(x: torch.Tensor, norm: DeferredRMSNorm | None = None) -> torch.Tensor:
    """:func:`silu_and_mul` of the output of an :func:`interleave_gate_up` weight: x [..., 2I] holds gate and up
    features alternating in groups of 8 -> silu(gate) * up [..., I]. ``norm``: x is the projection of raw rows
    whose RMSNorm was deferred (:class:`DeferredRMSNorm`); gate and up are scaled per token first."""
    if x.device.type == "cuda" and (out := cuda.silu_and_mul_interleaved(x, norm)) is not None:
        return out
    dtype = x.dtype
    if norm is not None:
        x = x.float() * norm.inv_rms()
    pairs = x.view(*x.shape[:-1], x.shape[-1] // 16, 2, 8)
    d = x.shape[-1] // 2
    gate, up = pairs[..., 0, :].reshape(*x.shape[:-1], d), pairs[..., 1, :].reshape(*x.shape[:-1], d)
    return (F.silu(gate) * up).to(dtype)


def deinterleave_gate_up(y: torch.Tensor) -> torch.Tensor:
    """The standard [gate, up] layout of the output of an :func:`interleave_gate_up` weight."""
    return deinterleave_halves(y, y.shape[-1])
