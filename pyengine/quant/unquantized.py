"""Dense weights (safetensors, or F32/F16/BF16 GGUF tensors) multiplied with ``F.linear``, or on CUDA with
the skinny GEMM kernel for decode-sized batches (M <= 16 rows, f16/bf16), which reads the weight once."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.ops.activation import (
    deinterleave_gate_up,
    interleave_gate_up,
    silu_and_mul_interleaved,
)
from candle_vllm.pyengine.quant.base import LinearMethod


class UnquantizedLinear(LinearMethod):
    """A plain [out, in] weight in the model dtype.

    ``gate_up_interleaved``: the weight is a fused [gate; up] projection, stored with its rows interleaved in
    groups of 8 (``ops.activation.interleave_gate_up``) so :meth:`forward_swiglu`'s decode GEMM applies the SiLU
    in its epilogue; :meth:`forward` still returns the [gate, up] layout.
    """

    def __init__(self, weight: torch.Tensor, gate_up_interleaved: bool = False) -> None:
        super().__init__()
        self.gate_up_interleaved = gate_up_interleaved
        self.weight = nn.Parameter(interleave_gate_up(weight) if gate_up_interleaved else weight, requires_grad=False)
        self.out_features, self.in_features = weight.shape

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cuda" and cuda.skinny_gemm_supported(x, self.weight):
            return cuda.skinny_gemm(x, self.weight)
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return deinterleave_gate_up(y) if self.gate_up_interleaved else y

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up: decode batches take the skinny GEMM with the SiLU in its epilogue, larger ones the
        GEMM then the interleaved SiLU kernel; None for a weight that is not an interleaved gate/up pair."""
        if not self.gate_up_interleaved:
            return None
        if x.device.type == "cuda" and cuda.skinny_gemm_supported(x, self.weight):
            return cuda.skinny_gemm(x, self.weight, silu_mul=True)
        return silu_and_mul_interleaved(F.linear(x, self.weight))
