"""Checked wrapper around the CUDA flash prefill kernel (``native/cuda/flash_prefill.cu``).

Why: prefill attention was the torch reference (K/V gathered per sequence, an explicit mask, every key of
every tile computed), the largest share of the time to first token after the linears. The kernel attends the
step's flattened query rows to the paged cache after ``reshape_and_cache`` wrote them, so chunked prefill and
prefix-cache hits read their cached prefix blocks with no special case. It takes raw device pointers; every
precondition it relies on is checked here.

The cache is of q's dtype or ``torch.float8_e4m3fn`` (``--kvcache-dtype fp8``, ``native/cuda/fp8_kv.cuh``): with
an e4m3 cache the kernel reads the cached bytes as they are and runs both products as f16 mma (q and the softmax
weights rounded to f16, f32 accumulation); q and the output stay f16/bf16.
"""

from __future__ import annotations

import torch

from candle_vllm.pyengine.ops import cuda, native

HEAD_DIMS = (64, 128, 256)


def flash_prefill_supported(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """True when :func:`flash_prefill` handles q [T, Hq, D] over kv_cache [2, blocks, block_size, Hk, D]:
    f16/bf16 q on a CUDA device with a cache of q's dtype or e4m3 (``torch.float8_e4m3fn``), D in 64/128/256,
    Hq a multiple of Hk, q's heads packed with a token stride that keeps every row 16-byte aligned (views into
    the fused qkv buffer qualify)."""
    if not (cuda.available(q.device) and q.dtype in cuda.HALF_DTYPES and cuda.cache_holds(kv_cache, q.dtype)):
        return False
    if q.dim() != 3 or kv_cache.dim() != 5 or kv_cache.device != q.device:
        return False
    hk, d = kv_cache.shape[3], kv_cache.shape[4]
    return (
        q.shape[2] == d
        and d in HEAD_DIMS
        and q.shape[1] % hk == 0
        and q.stride(2) == 1
        and (q.shape[1] == 1 or q.stride(1) == d)
        and q.stride(0) % 8 == 0
        and kv_cache.is_contiguous()
        and q.data_ptr() % 16 == 0
        and kv_cache.data_ptr() % 16 == 0
    )


# (block_m query rows per CTA, warp_rows per warp, block_n keys per K/V tile) compiled per head dim.
KERNEL_CONFIGS: dict[int, tuple[tuple[int, int, int], ...]] = {
    64: ((128, 16, 64), (128, 32, 64), (64, 16, 64)),
    128: ((128, 16, 64), (128, 32, 64), (128, 32, 32), (64, 16, 64)),
    256: ((64, 16, 32),),
}
# The engine's choice per head dim: 128 rows as 4 warps x 32 (each K/V fragment feeds two mma tiles) ran 14 %
# faster than 8 warps x 16 and 24 % faster than 64-row tiles (H200, 4k causal, D = 128, benches/RESULTS.md
# 2026-11-30); D = 256 fits only 64 rows x 16 in registers and in the shared memory of sm_89.
DEFAULT_CONFIG: dict[int, tuple[int, int, int]] = {64: (128, 32, 64), 128: (128, 32, 64), 256: (64, 16, 32)}


def flash_prefill(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    skip_single_token: bool = False,
    config: tuple[int, int, int] | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of every sequence's new query rows over its cached context: q [T, Hq, D] -> [T, Hq, D].

    Sequence s owns rows ``query_start_loc[s]:query_start_loc[s+1]`` (int32 [S+1]), the last of its
    ``seq_lens[s]`` (int32 [S]) context tokens, all already in the cache and reached through ``block_tables``
    (int32 [S, max_blocks]). ``max_query_len`` (host int, >= every query length) sizes the grid. With
    ``skip_single_token`` the rows of one-token sequences are left unwritten, for the decode kernel to fill.
    ``config`` (one of ``KERNEL_CONFIGS[D]``) overrides the tiling (benchmarks and tests use it); ``out`` may be
    given to write into.
    """
    if not flash_prefill_supported(q, kv_cache):
        raise ValueError(
            "flash_prefill needs f16/bf16 q [T, Hq, D] (heads packed, token stride % 8 == 0) and a contiguous cache "
            "[2, blocks, block_size, Hk, D] of the same dtype or float8_e4m3fn, D in 64/128/256, Hq a multiple of Hk, "
            "16-byte aligned; "
            f"got q {tuple(q.shape)} {q.dtype} strides {q.stride()}, cache {tuple(kv_cache.shape)} {kv_cache.dtype}"
        )
    for name, ints in (("block_tables", block_tables), ("query_start_loc", query_start_loc), ("seq_lens", seq_lens)):
        if ints.dtype != torch.int32 or ints.device != q.device:
            raise ValueError(f"flash_prefill: {name} must be int32 on {q.device}, got {ints.dtype} on {ints.device}")
    block_tables, query_start_loc, seq_lens = (
        block_tables.contiguous(), query_start_loc.contiguous(), seq_lens.contiguous()
    )
    t, hq, d = q.shape
    _, _, block_size, hk, _ = kv_cache.shape
    tiling = DEFAULT_CONFIG[d] if config is None else tuple(config)
    if tiling not in KERNEL_CONFIGS[d]:
        raise ValueError(f"flash_prefill: config {tiling} is not compiled for head_dim {d}; use one of {KERNEL_CONFIGS[d]}")
    if out is None:
        out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    elif not (out.shape == q.shape and out.dtype == q.dtype and out.is_contiguous() and out.data_ptr() % 16 == 0):
        raise ValueError("flash_prefill: out must be a contiguous, 16-byte aligned tensor shaped and typed like q")
    native.loaded().cuda_flash_prefill(
        out.data_ptr(), q.data_ptr(), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(), block_tables.data_ptr(),
        query_start_loc.data_ptr(), seq_lens.data_ptr(), seq_lens.shape[0], max_query_len, hq, hk, d, q.stride(0),
        block_size, block_tables.shape[1], scale, softcap or 0.0, sliding_window or 0, *tiling, skip_single_token,
        native.dtype_code(q), native.dtype_code(kv_cache), native.stream(q.device),
    )
    return out
