"""GGUF-quantized weights: kept as the file's uint8 blocks and multiplied by ``ops.quant_matmul``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from candle_vllm.pyengine.ops import cuda_gguf
from candle_vllm.pyengine.ops.q8_activation import BLOCK, Q8Activation, fusion_enabled
from candle_vllm.pyengine.ops.quant import GEMV_PASSES_MAX_ROWS, quant_matmul
from candle_vllm.pyengine.quant.base import LinearMethod


@dataclass
class GGUFWeight:
    """Raw blocks of a quantized tensor: ``data`` uint8 [rows, row_bytes], logical torch ``shape``."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]


class GGUFLinear(LinearMethod):
    """A quantized [out, in] matrix; rows are independent, so fused shards concatenate row-wise."""

    def __init__(self, weight: GGUFWeight, device: torch.device) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"a GGUF linear weight must be 2-D, got shape {weight.shape}")
        self.register_buffer("data", weight.data.to(device), persistent=False)
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape

    @classmethod
    def merged(cls, weights: Sequence[GGUFWeight], device: torch.device) -> GGUFLinear:
        """One method for row shards sharing a quant type (e.g. q, k and v of one layer)."""
        if len(weights) == 1:
            return cls(weights[0], device)
        data = torch.cat([w.data.reshape(w.shape[0], -1) for w in weights])
        out = sum(w.shape[0] for w in weights)
        return cls(GGUFWeight(data, weights[0].qtype, (out, weights[0].shape[1])), device)

    def accepts_q8(self, rows: int) -> bool:
        """True where the CUDA dp4a GEMV serves this weight for ``rows`` (<= GEMV_PASSES_MAX_ROWS) rows: it then
        reads the codes a norm/SiLU kernel wrote instead of quantizing the input itself. CANDLE_VLLM_Q8_FUSION=0
        turns it off."""
        return (
            1 <= rows <= GEMV_PASSES_MAX_ROWS
            and self.in_features % BLOCK == 0
            and fusion_enabled()
            and cuda_gguf.type_supported_on(self.data.device, self.qtype)
            and cuda_gguf.dp4a_supported(self.qtype)
        )

    def forward(self, x: torch.Tensor | Q8Activation) -> torch.Tensor:
        return quant_matmul(x, self.data, self.qtype, self.out_features, self.in_features)
