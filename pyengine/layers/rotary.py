"""Rotary embedding module: a precomputed cos/sin table applied by token position."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from candle_vllm.pyengine.ops.rotary import apply_rotary, rope_cos_sin_cache, rope_inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates q and k by absolute position; the table covers ``max_positions`` positions."""

    cos_sin_cache: torch.Tensor  # a buffer

    def __init__(
        self,
        rotary_dim: int,
        max_positions: int,
        rope_theta: float,
        rope_scaling: dict[str, Any] | None,
        is_neox: bool,
        device: torch.device,
        freq_factors: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_inv_freq(rotary_dim, rope_theta, rope_scaling, freq_factors)
        cache = rope_cos_sin_cache(inv_freq, attention_factor, max_positions, device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)
        self.is_neox = is_neox

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, pair_group: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pair_group``: q/k heads with interleaved halves in groups of that size (``ops.rotary.apply_rotary``)."""
        return apply_rotary(q, k, positions, self.cos_sin_cache, self.is_neox, pair_group)
