"""Linear layers whose weight format is decided when the checkpoint's tensors arrive."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from candle_vllm.pyengine.layers.embedding import VocabEmbedding
from candle_vllm.pyengine.layers.module_list import module_list
from candle_vllm.pyengine.ops.activation import silu_and_mul
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation
from candle_vllm.pyengine.ops.rotary import RopeCacheTarget
from candle_vllm.pyengine.quant import LinearMethod, UnquantizedLinear, WeightData, build_linear_methods


class Linear(nn.Module):
    """``y = x @ W.T (+ b)`` where W is the row-concatenation of ``len(output_sizes)`` shards.

    Fusing q/k/v (or gate/up) into one layer makes one matmul out of several; ``gated`` marks a [gate, up] pair
    whose consumer is :meth:`forward_swiglu`, ``rope_head_dim`` a [q, k, v] triple rotated by neox RoPE over whole
    heads of that size (whose consumer tries :meth:`forward_rope_cache` first). Shards are collected with :meth:`load_shard` and turned into
    :class:`LinearMethod` s (dense or quantized) by :meth:`finalize`.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
        gated: bool = False,
        rope_head_dim: int = 0,
    ) -> None:
        super().__init__()
        self.gated, self.rope_head_dim = gated, rope_head_dim
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.dtype, self.device = dtype, device
        self.methods: Sequence[LinearMethod] = module_list(())
        self._pending: dict[int, WeightData] = {}
        self.bias = (
            nn.Parameter(torch.empty(sum(output_sizes), dtype=dtype, device=device), requires_grad=False)
            if bias
            else None
        )

    def shard_shape(self, shard: int) -> tuple[int, int]:
        return (self.output_sizes[shard], self.in_features)

    def load_shard(self, shard: int, weight: WeightData) -> None:
        """Accept shard ``shard``'s weight; the layer is built once every shard is there."""
        shape = tuple(weight.shape)
        if shape != self.shard_shape(shard):
            raise ValueError(f"weight shape {list(shape)} does not match the model's {list(self.shard_shape(shard))}")
        self._pending[shard] = weight
        if len(self._pending) == len(self.output_sizes):
            shards = [self._pending[i] for i in range(len(self.output_sizes))]
            self._pending.clear()
            self.methods = module_list(build_linear_methods(
                shards, self.dtype, self.device, self.gated, self.rope_head_dim
            ))

    def load_bias(self, shard: int, bias: torch.Tensor) -> None:
        if self.bias is None or bias.shape != (self.output_sizes[shard],):
            raise ValueError(f"unexpected bias of shape {list(bias.shape)}")
        start = sum(self.output_sizes[:shard])
        self.bias.data[start : start + bias.shape[0]].copy_(bias)

    def tie_to(self, embedding: VocabEmbedding) -> None:
        """Share the token embedding matrix as this layer's weight (tied LM head)."""
        self.methods = module_list([embedding.as_linear_method()])

    @property
    def loaded(self) -> bool:
        return len(self.methods) > 0

    def q8_group(self, rows: int) -> int:
        """0, or the scale group (values per scale, 32 or 256) of the int8 codes :meth:`forward` uses from a
        ``Q8Activation`` input of ``rows`` rows (one weight method that takes them), so the producer of the input
        should write such codes."""
        return self.methods[0].q8_group(rows) if len(self.methods) == 1 else 0

    def _dense_unless_taken(self, x: torch.Tensor | Q8Activation) -> torch.Tensor | Q8Activation:
        """x, or its dense tensor where its codes are not the ones the weight method takes."""
        if isinstance(x, Q8Activation) and x.group != self.q8_group(x.rows):
            return x.x
        return x

    def forward(self, x: torch.Tensor | Q8Activation) -> torch.Tensor:
        x = self._dense_unless_taken(x)
        methods = self.methods
        y = methods[0](x) if len(methods) == 1 else torch.cat([m(x) for m in methods], dim=-1)
        return y + self.bias if self.bias is not None else y

    def forward_swiglu(
        self, x: torch.Tensor | Q8Activation, *, q8: int = 0, norm: DeferredRMSNorm | None = None
    ) -> torch.Tensor | Q8Activation:
        """``silu_and_mul(self(x))`` for a gate/up layer (``gated``), in one kernel where the weight method has one
        (dense f16/bf16 on CUDA); ``q8`` asks the separate SiLU for int8 codes of that scale group (the next
        linear's :meth:`q8_group`). ``norm``: x is raw rows whose RMSNorm is deferred to the SiLU
        (:class:`DeferredRMSNorm`)."""
        if self.bias is None and len(self.methods) == 1 and isinstance(x, torch.Tensor):
            y = self.methods[0].forward_swiglu(x, norm)
            if y is not None:
                return y
        y = self(x)
        return silu_and_mul(y if norm is None else norm.apply(y), q8=q8)

    def add_into(self, x: torch.Tensor | Q8Activation, out: torch.Tensor) -> torch.Tensor:
        """``out += self(x)`` in place, inside the GEMM where the weight method can (``LinearMethod.add_into``, dense
        x); returns out."""
        one = self.methods[0] if self.bias is None and len(self.methods) == 1 else None
        if not (one is not None and isinstance(x, torch.Tensor) and one.add_into(x, out)):
            out += self(x)
        return out

    @property
    def dense(self) -> bool:
        """Whether every weight method holds a plain dense matrix (no quantized blocks)."""
        return self.loaded and all(isinstance(m, UnquantizedLinear) for m in self.methods)

    def fold_input_scale(self, scale: torch.Tensor) -> None:
        """``W[:, k] *= scale[k]`` (an RMSNorm's weight moved into this layer); dense weights only."""
        if not self.dense:
            raise ValueError("fold_input_scale: only dense weights can take a norm's weight into their columns")
        for m in self.methods:
            m.scale_input_columns(scale)  # type: ignore[operator]


    @property
    def rope_pair_group(self) -> int:
        """0, or the group in which :meth:`forward`'s q/k heads come with interleaved halves
        (``LinearMethod.rope_pair_group``)."""
        return self.methods[0].rope_pair_group if len(self.methods) == 1 else 0

    def forward_rope_cache(self, x: torch.Tensor | Q8Activation, target: RopeCacheTarget) -> torch.Tensor | None:
        """``self(x)`` with q/k rotated (neox, whole heads) and k/v stored in ``target``'s cache in one kernel, where
        the weight method has one (dense f16/bf16 or GGUF with a dp4a GEMV on CUDA, decode batches); None, having
        done nothing, elsewhere. x's int8 codes go along where the method takes them."""
        if self.bias is not None or len(self.methods) != 1:
            return None
        return self.methods[0].forward_rope_cache(self._dense_unless_taken(x), target)
