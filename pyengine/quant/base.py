"""The LinearMethod interface and the choice of method for a (possibly fused) layer's weight shards."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Union

import torch
from torch import nn

if TYPE_CHECKING:
    from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
    from candle_vllm.pyengine.ops.q8_activation import Q8Activation
    from candle_vllm.pyengine.ops.rotary import RopeCacheTarget
    from candle_vllm.pyengine.quant.gguf import GGUFWeight

# A weight as it arrives from a checkpoint: a dense tensor, or quantized blocks with their format.
WeightData = Union[torch.Tensor, "GGUFWeight"]


class LinearMethod(nn.Module, ABC):
    """Owns one weight matrix [out_features, in_features] in some storage format and multiplies by it.

    A module (not a stateless strategy) so ``.to(device)`` and state inspection cover the stored tensors.
    """

    out_features: int
    in_features: int

    @abstractmethod
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features] -> x @ W.T [..., out_features]`` in x's dtype."""

    def q8_group(self, rows: int) -> int:
        """0, or the scale group (32 or 256 values) of the int8 codes :meth:`forward` uses, for ``rows`` rows, from
        an ``ops.q8_activation.Q8Activation`` (activations with codes written by their producer); the producer may
        then be asked for such codes."""
        return 0

    def forward_swiglu(self, x: torch.Tensor, norm: DeferredRMSNorm | None = None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a fused gate/up weight in one kernel where this method has one (the SiLU then
        costs no launch of its own), gate and up scaled per token by ``norm`` where given; None when it has none,
        and the caller applies ``silu_and_mul`` to :meth:`forward`'s output."""
        return None

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """``out += x @ W.T`` inside the GEMM (the residual add of o_proj / down_proj, no launch of its own) where
        this method can; False, having done nothing, where it cannot."""
        return False

    @property
    def rope_pair_group(self) -> int:
        """0, or the group size (8 dense, 1 GGUF) in which :meth:`forward` returns the q/k heads of a q/k/v
        projection with their halves interleaved (``ops.row_pairs``), to be rotated with that ``pair_group``
        (``ops.rotary.apply_rotary``): the layout its :meth:`forward_rope_cache` kernel needs the weight in."""
        return 0

    def forward_rope_cache(self, x: torch.Tensor | Q8Activation, target: RopeCacheTarget) -> torch.Tensor | None:
        """A q/k/v projection with neox RoPE applied to q/k and k/v stored into the paged cache of ``target`` in
        the GEMM itself, or None where this method has no such kernel (the caller then projects, rotates and
        stores). x is a ``Q8Activation`` only where :meth:`q8_group` asked for its codes."""
        return None


def build_linear_methods(
    shards: Sequence[WeightData],
    dtype: torch.dtype,
    device: torch.device,
    gated: bool = False,
    rope_head_dim: int = 0,
) -> list[LinearMethod]:
    """Methods for a layer whose weight is the row-concatenation of ``shards`` (e.g. q, k, v).

    Consecutive shards in the same format are merged into one matrix so the layer runs one matmul per
    format run; GGUF files may store q/k and v in different quant types, which then stay separate. ``gated``
    (the shards are a gate and an up projection): a dense f16/bf16 pair on CUDA is stored interleaved so its
    decode GEMM applies the SiLU itself (``UnquantizedLinear.forward_swiglu``). ``rope_head_dim`` (the shards are
    q, k and v, rotated by neox RoPE over whole heads of that size): a dense f16/bf16 q/k/v on CUDA, or a GGUF one
    of a type with the dp4a GEMV there, is stored with each q/k head's halves interleaved so its decode GEMM/GEMV
    rotates and caches (``forward_rope_cache``).
    """
    from candle_vllm.pyengine.quant.gguf import GGUFLinear, GGUFWeight, rope_epilogue_possible
    from candle_vllm.pyengine.quant.unquantized import UnquantizedLinear

    methods: list[LinearMethod] = []
    run: list[WeightData] = []

    def flush() -> None:
        if not run:
            return
        qkv = len(run) == len(shards) == 3 and rope_head_dim > 0  # the whole q/k/v in one format
        if isinstance(run[0], GGUFWeight):
            rope = qkv and rope_epilogue_possible(run[0].qtype, device, dtype)
            methods.append(GGUFLinear.merged(
                [w for w in run if isinstance(w, GGUFWeight)], device,
                rope_rows=run[0].shape[0] + run[1].shape[0] if rope else 0, head_dim=rope_head_dim if rope else 0,
            ))
        else:
            dense = [w.to(device, dtype) for w in run if isinstance(w, torch.Tensor)]  # a run is of one kind
            weight = torch.cat(dense) if len(dense) > 1 else dense[0]
            whole = device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and len(run) == len(shards)
            interleave = whole and gated and len(run) == 2 and weight.shape[0] % 16 == 0
            rope = whole and qkv
            rope_rows = run[0].shape[0] + run[1].shape[0] if rope else 0
            methods.append(UnquantizedLinear(weight, gate_up_interleaved=interleave, rope_rows=rope_rows,
                                             head_dim=rope_head_dim if rope else 0))
        run.clear()

    for w in shards:
        if run and _format_key(run[0]) != _format_key(w):
            flush()
        run.append(w)
    flush()
    return methods


def _format_key(w: WeightData) -> object:
    return w.qtype if not isinstance(w, torch.Tensor) else "dense"
