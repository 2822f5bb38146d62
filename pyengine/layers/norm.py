"""RMSNorm module over the ``ops.rms_norm`` kernels."""

from __future__ import annotations

import torch
from torch import nn

from candle_vllm.pyengine.ops import fused_add_rms_norm, rms_norm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (returns the updated residual too)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None, *, q8: int = 0
    ) -> torch.Tensor | Q8Activation | tuple[torch.Tensor | Q8Activation, torch.Tensor]:
        """``q8``: the scale group of the int8 codes the consuming linear takes (``Linear.q8_group``; 0: none):
        the normed output then comes as a :class:`Q8Activation` where the kernel can write them."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps, q8=q8)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, q8=q8)
