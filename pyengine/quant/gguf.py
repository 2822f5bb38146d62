"""GGUF-quantized weights: kept as the file's uint8 blocks and multiplied by ``ops.quant_matmul``."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType

from candle_vllm.pyengine.ops import cuda_gguf
from candle_vllm.pyengine.ops.q8_activation import BLOCK, Q8Activation, dense, fusion_enabled
from candle_vllm.pyengine.ops.quant import q8_group, quant_matmul, takes_mmq
from candle_vllm.pyengine.ops.rotary import RopeCacheTarget
from candle_vllm.pyengine.ops.row_pairs import interleave_halves
from candle_vllm.pyengine.quant.base import LinearMethod

# The GGUF q/k/v layout for the GEMV's RoPE epilogue: each head's halves interleaved row by row (ops.row_pairs).
ROPE_PAIR_GROUP = 1


@dataclass
class GGUFWeight:
    """Raw blocks of a quantized tensor: ``data`` uint8 [rows, row_bytes], logical torch ``shape``."""

    data: torch.Tensor
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]


@functools.cache
def rope_epilogue_enabled() -> bool:
    """False when ``CANDLE_VLLM_GGUF_ROPE=0`` (read once): GGUF q/k/v weights then keep their file layout and
    decode rotates in its own kernel, so benchmarks can A/B the fused epilogue."""
    return os.environ.get("CANDLE_VLLM_GGUF_ROPE", "1").strip() != "0"


def rope_epilogue_possible(qtype: GGMLQuantizationType, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a GGUF q/k/v weight of ``qtype`` on ``device`` (activations in ``dtype``) can be served by the
    RoPE + cache epilogue (on the dp4a GEMV, and on the tensor-core product where a batch takes it), and so is worth
    storing in its paired layout."""
    return (
        rope_epilogue_enabled()
        and dtype in (torch.float16, torch.bfloat16)
        and cuda_gguf.type_supported_on(device, qtype)
        and cuda_gguf.dp4a_supported(qtype)
    )


class GGUFLinear(LinearMethod):
    """A quantized [out, in] matrix; rows are independent, so fused shards concatenate row-wise.

    ``rope_rows`` / ``head_dim``: the weight is a fused q/k/v projection whose first ``rope_rows`` rows (the q and
    k heads) are stored with each head's halves interleaved row by row (``ops.row_pairs``, group 1; a gather of
    whole block rows at load), so the CTAs of the decode products (the dp4a GEMV, the tensor-core product) own
    whole rotation pairs and :meth:`forward_rope_cache` rotates and stores k/v in their epilogue; :meth:`forward`
    returns the q/k heads in that layout (``rope_pair_group``), which the RoPE kernels read and leave in the standard
    one. On a CUDA device whose kernels decode the type, the blocks are kept as those kernels read them
    (``cuda_gguf.device_layout``: the rows of Q6_K, Q3_K, Q8_0 and Q5_0 regrouped for aligned loads).
    """

    data: torch.Tensor  # a buffer: the blocks as uint8

    def __init__(self, weight: GGUFWeight, device: torch.device, rope_rows: int = 0, head_dim: int = 0) -> None:
        super().__init__()
        if len(weight.shape) != 2:
            raise ValueError(f"a GGUF linear weight must be 2-D, got shape {weight.shape}")
        data = weight.data.to(device)
        if rope_rows:
            rows = data.reshape(weight.shape[0], -1)
            data = torch.cat([interleave_halves(rows[:rope_rows], head_dim, ROPE_PAIR_GROUP), rows[rope_rows:]])
        if device.type == "cuda" and cuda_gguf.type_supported_on(device, weight.qtype):
            data = cuda_gguf.device_layout(data, weight.qtype, *weight.shape)
        self.register_buffer("data", data, persistent=False)
        self.qtype = weight.qtype
        self.out_features, self.in_features = weight.shape
        self.rope_rows, self.head_dim = rope_rows, head_dim

    @classmethod
    def merged(
        cls, weights: Sequence[GGUFWeight], device: torch.device, rope_rows: int = 0, head_dim: int = 0
    ) -> GGUFLinear:
        """One method for row shards sharing a quant type (e.g. q, k and v of one layer); ``rope_rows`` and
        ``head_dim`` as in the constructor."""
        if len(weights) == 1:
            return cls(weights[0], device, rope_rows, head_dim)
        data = torch.cat([w.data.reshape(w.shape[0], -1) for w in weights])
        out = sum(w.shape[0] for w in weights)
        return cls(GGUFWeight(data, weights[0].qtype, (out, weights[0].shape[1])), device, rope_rows, head_dim)

    def q8_group(self, rows: int) -> int:
        """Where a CUDA int8-activation kernel serves this weight for ``rows`` rows (the dp4a GEMV and its passes,
        or the tensor-core product), the scale group of the codes it takes (``ops.quant.q8_group``): it then reads
        the codes a norm/SiLU kernel wrote instead of quantizing the input itself; else 0.
        CANDLE_VLLM_Q8_FUSION=0 turns it off."""
        if not (
            self.in_features % BLOCK == 0
            and fusion_enabled()
            and cuda_gguf.type_supported_on(self.data.device, self.qtype)
            and cuda_gguf.dp4a_supported(self.qtype)
        ):
            return 0
        return q8_group(self.qtype, rows, self.out_features, self.in_features)

    def forward(self, x: torch.Tensor | Q8Activation) -> torch.Tensor:
        return quant_matmul(x, self.data, self.qtype, self.out_features, self.in_features)

    @property
    def rope_pair_group(self) -> int:
        return ROPE_PAIR_GROUP if self.rope_rows else 0

    def forward_rope_cache(self, x: torch.Tensor | Q8Activation, target: RopeCacheTarget) -> torch.Tensor | None:
        """The projection with q/k rotated and k/v stored at their slots in the epilogue of the product a decode
        batch of its size takes (``cuda_gguf.gemv_rope_cache``: the dp4a GEMV up to 8 rows, the tensor-core product
        from ``ops.quant.mmq_min_rows`` to 32), for a weight stored with paired halves; None (nothing done)
        elsewhere."""
        if not self.rope_rows or dense(x).device.type != "cuda":
            return None
        tensor_cores = takes_mmq(dense(x), self.data, self.qtype, self.out_features, self.in_features)
        return cuda_gguf.gemv_rope_cache(
            x, self.data, self.qtype, self.out_features, self.in_features, self.head_dim, *target,
            tensor_cores=tensor_cores,
        )
