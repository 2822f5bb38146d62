"""CUDA steps over a TurboQuant cache (``kv_cache/turbo.py``): pure decode steps (CUDA graphs too) and the one-token
rows of other steps on the rows' own decode kernel; fresh prompts on torch's cuDNN / flash attention over the
step's own K/V, rounded to what the cache holds of them (``cuda_turbo.turbo_cache_write(round_trip=True)``); the
other multi-token sequences on the flash prefill kernel over their blocks decoded to dense f16/bf16 once per layer
(``cuda_turbo.blocks_to_dense``). The queries stay unrotated: the decode kernel rotates them itself, and the dense
blocks hold K turned back."""

from __future__ import annotations

import torch

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda_turbo, sdpa_prefill
from candle_vllm.pyengine.ops.attention_cuda import attend_fresh_runs, decode_rows_into, native_rows
from candle_vllm.pyengine.ops.attention_metadata import AttentionMetadata
from candle_vllm.pyengine.ops.cuda_prefill import KERNEL_CONFIGS, flash_prefill, flash_prefill_supported

# The flash prefill kernel's widest K/V tile (powers of two): under a sliding window its first tile starts at the
# window's start rounded down to a multiple of its own width, so never before the start rounded down to this.
FLASH_KEY_TILE = max(bn for configs in KERNEL_CONFIGS.values() for _, _, bn in configs)


def turbo_step(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    fmt: TurboFormat,
    fresh: tuple[str, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """Attention of a step whose K/V are already in the TurboQuant cache: q [T, Hq, D] (unrotated) -> [T, Hq, D];
    None where the decode kernel does not take the cache (the caller falls back to the torch reference).
    ``fresh`` = (torch backend, k, v): the step's own K/V as the cache holds them, for its fresh prompts."""
    assert meta.block_tables is not None
    if not cuda_turbo.decode_supported(q, kv_cache, fmt):
        return None
    if meta.max_decode_seq_len is not None or meta.query_start_loc_cpu == list(range(q.shape[0] + 1)):
        longest = meta.max_decode_seq_len or max(meta.seq_lens_cpu or [1])
        return cuda_turbo.turbo_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale, longest, fmt,
                                                 sliding_window, softcap)
    got = attend_fresh_runs(fresh[0], q, fresh[1], fresh[2], meta, scale) if fresh is not None else None
    out, done = got if got is not None else (None, set())
    q_lens = meta.query_lens_cpu
    one_token = [s for s, n in enumerate(q_lens) if n == 1 and s not in done]
    multi = [s for s, n in enumerate(q_lens) if n > 1 and s not in done]
    if multi:
        cache, tables = _dense_cache(q.dtype, kv_cache, meta, multi, sliding_window, fmt)
        if out is not None:
            native_rows(q, out, cache, meta, multi, scale, tables)
        else:
            if not flash_prefill_supported(q, cache):  # q's strides or alignment: a fresh packed copy qualifies
                q = q.clone(memory_format=torch.contiguous_format)
            out = flash_prefill(q, cache, tables, meta.query_start_loc, meta.seq_lens, max(q_lens), scale,
                                sliding_window, softcap, skip_single_token=bool(one_token))
            sdpa_prefill.ROUTES["native"] += 1
    elif out is None:
        out = torch.empty_like(q)
    if one_token:
        turbo_decode_rows(q, out, kv_cache, meta, one_token, scale, sliding_window, softcap, fmt)
    return out


def _dense_cache(
    dtype: torch.dtype,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    seqs: list[int],
    sliding_window: int | None,
    fmt: TurboFormat,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences ``seqs``' context blocks decoded to a dense cache [2, n, block_size, Hk, D] of ``dtype``, and block
    tables [S, width] int32 into it. Only blocks a query can
    reach are decoded (under a sliding window, from the first query's window start rounded down to a whole key
    tile); the others, and other sequences' rows, point at block 0, which the kernel never reads for them. The
    index lists are host arithmetic, built once per step; the block ids are gathered on the device."""
    assert meta.block_tables is not None and meta.seq_lens_cpu is not None
    bs = kv_cache.shape[2]
    lens, q_lens = meta.seq_lens_cpu, meta.query_lens_cpu
    span: dict[int, range] = {}
    for s in seqs:
        start = max(0, lens[s] - q_lens[s] - sliding_window + 1) if sliding_window else 0
        span[s] = range(start // FLASH_KEY_TILE * FLASH_KEY_TILE // bs, (lens[s] + bs - 1) // bs)
    width = max(r.stop for r in span.values())
    key = f"turbo_dense{seqs}"
    rows = meta.device_ints(key + "rows", lambda: [s for s in seqs for _ in span[s]])
    cols = meta.device_ints(key + "cols", lambda: [c for s in seqs for c in span[s]])

    def tables() -> list[int]:
        flat, first = [], 0
        for s in range(meta.num_seqs):
            r = span.get(s, range(0))
            flat += [0] * r.start + list(range(first, first + len(r))) + [0] * (width - r.stop)
            first += len(r)
        return flat

    cache = torch.empty(2, len(cols), bs, kv_cache.shape[3], fmt.head_dim, dtype=dtype, device=kv_cache.device)
    cuda_turbo.blocks_to_dense(kv_cache, meta.block_tables[rows, cols].long(), fmt, cache)
    return cache, meta.device_ints(key + "tables", tables, torch.int32).view(meta.num_seqs, width)


def turbo_decode_rows(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    fmt: TurboFormat,
) -> None:
    """The one-token sequences ``rows`` of a step with prefill rows, through the TurboQuant decode kernel
    (unrotated q) into ``out``."""
    decode_rows_into(out, q, meta, rows, lambda qr, tables, lens, longest: cuda_turbo.turbo_decode_attention(
        qr, kv_cache, tables, lens, scale, longest, fmt, sliding_window, softcap))
