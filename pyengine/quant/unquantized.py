"""Dense weights (safetensors, or F32/F16/BF16 GGUF tensors) multiplied with ``F.linear``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from candle_vllm.pyengine.quant.base import LinearMethod
from torch import nn


class UnquantizedLinear(LinearMethod):
    """A plain [out, in] weight in the model dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)
