"""Dense weights (safetensors, or F32/F16/BF16 GGUF tensors) multiplied with ``F.linear``, or on CUDA with
the skinny GEMM kernel for decode-sized batches (M <= 16 rows, f16/bf16), which reads the weight once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.quant.base import LinearMethod


class UnquantizedLinear(LinearMethod):
    """A plain [out, in] weight in the model dtype."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and cuda.skinny_gemm_supported(x, self.weight):
            return cuda.skinny_gemm(x, self.weight)
        return F.linear(x, self.weight)
