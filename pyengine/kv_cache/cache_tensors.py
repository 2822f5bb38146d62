"""Per-layer paged KV cache tensors in the layout attention reads (contract C)."""

from __future__ import annotations

import torch

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, device: torch.device,
                       turbo_format: TurboFormat | None = None) -> list[torch.Tensor]:
    """One ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` tensor per layer (index 0 = K, 1 = V), or with
    ``turbo_format`` one ``[1, num_blocks, block_size, num_kv_heads, row_bytes]`` uint8 tensor (``turbo.py``).

    Zero-filled rather than left uninitialised: padded attention reads multiply stale slots by zero weight,
    and stale NaN bits would turn that into NaN.
    """
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    if turbo_format is not None:  # a zero row decodes to zeros
        shape, dtype = (1, num_blocks, block_size, num_kv_heads, turbo_format.row_bytes), torch.uint8
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
