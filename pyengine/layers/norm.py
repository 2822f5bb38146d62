"""RMSNorm module over the ``ops.rms_norm`` kernels."""

from __future__ import annotations

import torch
from torch import nn

from candle_vllm.pyengine.ops import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """RMSNorm with an optional fused residual add (returns the updated residual too)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype, device=device), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
