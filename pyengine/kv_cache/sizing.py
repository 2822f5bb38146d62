"""How many KV blocks to allocate: a fraction of the memory left after loading, or a fixed budget.

`--kv-fraction` wins over `--mem` when both are given (the Rust project's rule, NOTES.md); EngineArgs leaves
`kv_fraction` unset when only `--mem` is given. On CPU the "free memory" is the host's available RAM, and the
default budget is capped (``CPU_KV_CAP_BYTES``) so a server never claims most of a workstation unasked; a fraction
the user gives is taken as given.
"""

from __future__ import annotations

import logging
import os

import torch

from candle_vllm.pyengine.engine_args import EngineConfigError
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat

logger = logging.getLogger(__name__)

CPU_KV_CAP_BYTES = 4 << 30
MIB = 1 << 20


def kv_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, turbo: TurboFormat | None = None
) -> int:
    """Bytes one token's K and V take across all layers (one rank's heads); ``turbo``: a TurboQuant cache's rows."""
    if turbo is not None:
        return num_layers * num_kv_heads * turbo.row_bytes
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * elem


def host_available_bytes() -> int:
    """RAM the OS could hand out now: MemAvailable from /proc/meminfo, else free pages (macOS, BSD)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def device_free_bytes(device: torch.device) -> int:
    """Memory free on ``device`` now (after the weights were loaded). On CUDA the allocator first returns the
    blocks it caches for nothing (the loader's temporaries: a fused projection's concatenation, its interleaved or
    transposed copy), which the driver would otherwise count as used."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    if device.type == "mps":
        return int(torch.mps.recommended_max_memory() - torch.mps.driver_allocated_memory())
    if device.type == "cpu":
        return host_available_bytes()
    raise ValueError(f"cannot size a KV cache on device type {device.type!r}; use cuda, mps or cpu")


def kv_cache_budget_bytes(
    device: torch.device, kv_fraction: float | None, mem_mb: int | None, *, cap_cpu: bool = False
) -> int:
    """Bytes for the KV cache: ``kv_fraction`` of free memory when given, else the fixed ``mem_mb`` MiB.
    ``cap_cpu``: the fraction is the default one, so on CPU it is capped at ``CPU_KV_CAP_BYTES`` (logged)."""
    if kv_fraction is not None:
        if not 0.0 < kv_fraction <= 1.0:
            raise EngineConfigError(f"--kv-fraction must be in (0, 1], got {kv_fraction}")
        budget = int(device_free_bytes(device) * kv_fraction)
        if cap_cpu and device.type == "cpu" and budget > CPU_KV_CAP_BYTES:
            logger.info("KV cache: the default budget on CPU is capped at %d MiB (%.2f of available RAM would be "
                        "%d MiB); pass --kv-fraction or --mem for more", CPU_KV_CAP_BYTES // MIB, kv_fraction,
                        budget // MIB)
            return CPU_KV_CAP_BYTES
        return budget
    if mem_mb is not None:
        if mem_mb <= 0:
            raise EngineConfigError(f"--mem must be a positive number of MB, got {mem_mb}")
        return mem_mb * MIB
    raise EngineConfigError("no KV cache budget: pass --kv-fraction (fraction of free memory) or --mem (MB)")


def num_kv_blocks(budget_bytes: int, block_size: int, bytes_per_token: int) -> int:
    """Blocks that fit in ``budget_bytes``; logs the resulting token capacity. Raises when not even one fits."""
    block_bytes = block_size * bytes_per_token
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise EngineConfigError(
            f"the KV cache budget ({budget_bytes / MIB:.1f} MiB) holds no block of {block_size} tokens "
            f"({block_bytes / MIB:.2f} MiB); raise --kv-fraction or --mem, or lower --block-size")
    logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.1f MiB)", num_blocks, block_size,
                num_blocks * block_size, num_blocks * block_bytes / MIB)
    return int(num_blocks)
