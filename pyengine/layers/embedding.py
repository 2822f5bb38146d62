"""Token embeddings, dense or GGUF-quantized (only the looked-up rows are dequantized; on CUDA one gather
kernel decodes them straight from the quantized table)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from candle_vllm.pyengine.ops import cuda_gguf
from candle_vllm.pyengine.ops.quant import dequantize
from candle_vllm.pyengine.quant import GGUFLinear, GGUFWeight, LinearMethod, UnquantizedLinear, WeightData


class VocabEmbedding(nn.Module):
    """[vocab, hidden] lookup table. A quantized table stays quantized: a 150k-token vocabulary in Q4 is a
    fraction of its f16 size, and each step needs only T rows."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.dtype, self.device = dtype, device
        self.method: LinearMethod | None = None

    def load(self, weight: WeightData) -> None:
        if tuple(weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(
                f"embedding shape {list(weight.shape)} does not match the model's {[self.vocab_size, self.hidden_size]}"
            )
        if isinstance(weight, GGUFWeight):
            self.method = GGUFLinear(weight, self.device)
        else:
            self.method = UnquantizedLinear(weight.to(self.device, self.dtype))

    def as_linear_method(self) -> LinearMethod:
        """The table as an [vocab, hidden] linear weight, shared (not copied) with a tied LM head."""
        if self.method is None:
            raise RuntimeError("embedding weights are not loaded")
        return self.method

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        m = self.method
        if isinstance(m, UnquantizedLinear):
            return F.embedding(input_ids, m.weight)
        if isinstance(m, GGUFLinear):
            if cuda_gguf.type_supported_on(m.data.device, m.qtype):
                ids = input_ids.reshape(-1).to(torch.int64)
                out = cuda_gguf.dequantize(m.data, m.qtype, self.vocab_size, self.hidden_size, self.dtype, ids)
                return out.view(*input_ids.shape, self.hidden_size)
            rows = m.data.index_select(0, input_ids.reshape(-1))
            out = dequantize(rows, m.qtype, (rows.shape[0], self.hidden_size), self.dtype)
            return out.view(*input_ids.shape, self.hidden_size)
        raise RuntimeError("embedding weights are not loaded")
