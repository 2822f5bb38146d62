"""RMSNorm, plain and fused with the residual add: torch references and native dispatch."""

from __future__ import annotations

from typing import Literal, NamedTuple, overload

import torch

from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.q8_activation import Q8Activation, check_group, codes_for, producer_supported


class DeferredRMSNorm(NamedTuple):
    """An RMSNorm moved past the linear it feeds: the linear holds the norm's weight in its columns
    (``Linear.fold_input_scale``) and takes the raw ``rows`` [T, H], so its output [T, ...] lacks only each token's
    1 / rms(row), a per-row factor that commutes with the linear. The kernel consuming the output applies it (the
    RoPE + cache write after qkv, the SiLU after gate/up), which spares the norm its own launch: at a batch-64
    decode step every launch between two cuBLAS GEMMs costs 2-4 us however little it does (RESULTS.md). The CUDA
    consumers read the rows while the linear before them still runs, so that linear must be one that starts only
    after the rows' writer ended (cuBLAS, or our GEMMs: native/cuda/deferred_norm.h)."""

    rows: torch.Tensor
    eps: float

    def inv_rms(self) -> torch.Tensor:
        """f32 [T, 1]: each row's 1 / rms, with the norm kernels' f32 statistics."""
        xf = self.rows.float()
        return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)

    def apply(self, y: torch.Tensor) -> torch.Tensor:
        """Reference: y [T, ...] (a linear of the raw rows) scaled per token and rounded once to y's dtype."""
        scale = self.inv_rms().view(-1, *([1] * (y.dim() - 1)))
        return (y.float() * scale).to(y.dtype)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF Llama's RMSNorm: normalise in f32, cast back, then scale."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    residual = x + residual
    return rms_norm_reference(residual, weight, eps), residual


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, q8: Literal[0] = 0) -> torch.Tensor: ...
@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, q8: int) -> torch.Tensor | Q8Activation: ...
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, q8: int = 0) -> torch.Tensor | Q8Activation:
    """Normalise the last dimension of ``x``; returns a new tensor.

    Strided views (q/k heads cut from a fused qkv output, as q/k norms get them) are copied to take the native
    kernel too: otherwise a step's rounding would depend on whether its q happened to be contiguous, which is
    a matter of how many tokens share the step, and batch invariance would be lost.

    ``q8`` (0, or the scale group a GGUF linear that takes int8 activations asks for: ``Linear.q8_group``, see
    ``ops/q8_activation.py``): on CUDA with the native kernel, the same output wrapped in a :class:`Q8Activation`
    with its int8 codes; elsewhere the plain tensor."""
    check_group(q8)
    if not x.is_contiguous() and native.available(x.device):
        x = x.contiguous()
    if x.dtype == weight.dtype and native.ready(x, weight):
        out = torch.empty_like(x)
        hidden = x.shape[-1]
        rows, code = x.numel() // hidden, native.dtype_code(x)
        if x.device.type == "cpu":
            native.loaded().cpu_rms_norm(native.ptr(out), native.ptr(x), native.ptr(weight), rows, hidden, eps, code)
            return out
        stream = native.stream(x.device)
        if q8 and producer_supported(out, q8, x, weight):
            act = codes_for(out, q8)
            native.loaded().cuda_rms_norm_q8(
                native.ptr(out), native.ptr(act.xq), native.ptr(act.xb), q8, native.ptr(x), native.ptr(weight), rows,
                hidden, eps, code, stream,
            )
            return act
        native.loaded().cuda_rms_norm(native.ptr(out), native.ptr(x), native.ptr(weight), rows, hidden, eps, code, stream)
        return out
    return rms_norm_reference(x, weight, eps)


@overload
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, q8: Literal[0] = 0
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, q8: int
) -> tuple[torch.Tensor | Q8Activation, torch.Tensor]: ...
def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, q8: int = 0
) -> tuple[torch.Tensor | Q8Activation, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual); the native path works in place on x and residual.

    ``q8``: as :func:`rms_norm`'s, the first element then a :class:`Q8Activation` where the kernel runs."""
    check_group(q8)
    if x.dtype == residual.dtype == weight.dtype and native.ready(x, residual, weight):
        hidden = x.shape[-1]
        rows, code = x.numel() // hidden, native.dtype_code(x)
        if x.device.type == "cpu":
            native.loaded().cpu_fused_add_rms_norm(
                native.ptr(x), native.ptr(residual), native.ptr(weight), rows, hidden, eps, code
            )
            return x, residual
        stream = native.stream(x.device)
        if q8 and producer_supported(x, q8, residual, weight):
            act = codes_for(x, q8)
            native.loaded().cuda_fused_add_rms_norm_q8(
                native.ptr(x), native.ptr(residual), native.ptr(act.xq), native.ptr(act.xb), q8, native.ptr(weight),
                rows, hidden, eps, code, stream,
            )
            return act, residual
        native.loaded().cuda_fused_add_rms_norm(
            native.ptr(x), native.ptr(residual), native.ptr(weight), rows, hidden, eps, code, stream
        )
        return x, residual
    return fused_add_rms_norm_reference(x, residual, weight, eps)
