"""Paged KV cache (contract F): block bookkeeping and sizing here, cache tensors in ``cache_tensors``.

block_manager.pyx  KVCacheManager: ref-counted blocks, LRU free lists, prefix cache, per-request block tables
step_inputs.pyx    build_step_arrays: one step's slot mapping, positions, block tables ... for the runner
sizing.py          how many blocks fit: --kv-fraction of free memory or a fixed --mem budget
cache_tensors.py   per-layer ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache tensors
turbo.py           TurboQuant cache rows (--kvcache-dtype turbo8/4/3): format, encode/decode, rotation
"""

from candle_vllm.pyengine.kv_cache.block_manager import KVCacheManager
from candle_vllm.pyengine.kv_cache.cache_tensors import allocate_kv_caches
from candle_vllm.pyengine.kv_cache.sizing import kv_bytes_per_token, kv_cache_budget_bytes, num_kv_blocks
from candle_vllm.pyengine.kv_cache.step_inputs import build_step_arrays

__all__ = [
    "KVCacheManager",
    "allocate_kv_caches",
    "build_step_arrays",
    "kv_bytes_per_token",
    "kv_cache_budget_bytes",
    "num_kv_blocks",
]
