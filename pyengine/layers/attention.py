"""Attention layer: binds a layer's head geometry to ``ops.attention`` and its KV cache."""

from __future__ import annotations

import torch
from torch import nn

from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention


class Attention(nn.Module):
    """Scaled dot-product attention over the flat batch, reading/writing this layer's paged KV cache."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.softcap = scale, sliding_window, softcap

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        kv_cached: bool = False,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hk, D] -> [T, Hq*D]; ``kv_cached``: k/v are already in the cache."""
        out = attention(q, k, v, kv_cache, meta, self.scale, self.num_kv_heads, self.sliding_window, self.softcap,
                        kv_cached)
        return out.reshape(out.shape[0], -1)
