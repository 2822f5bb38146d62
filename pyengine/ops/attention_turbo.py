"""CUDA steps over a TurboQuant cache (``kv_cache/turbo.py``): pure decode steps (CUDA graphs too) and the one-token
rows of other steps on the rows' own decode kernel; the multi-token sequences of a step on the flash prefill kernel
over their blocks decoded to dense f16/bf16 once per layer (``cuda_turbo.blocks_to_dense``). The queries stay
unrotated: the decode kernel rotates them itself, and the dense blocks hold K turned back."""

from __future__ import annotations

import torch

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda_turbo, sdpa_prefill
from candle_vllm.pyengine.ops.attention_metadata import AttentionMetadata
from candle_vllm.pyengine.ops.cuda_prefill import flash_prefill, flash_prefill_supported


def turbo_step(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    fmt: TurboFormat,
) -> torch.Tensor | None:
    """Attention of a step whose K/V are already in the TurboQuant cache: q [T, Hq, D] (unrotated) -> [T, Hq, D];
    None where the kernels do not take the step (the caller falls back to the torch reference)."""
    assert meta.block_tables is not None
    decode_ok = cuda_turbo.decode_supported(q, kv_cache, fmt)
    if decode_ok and meta.max_decode_seq_len is not None:
        return cuda_turbo.turbo_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                                 meta.max_decode_seq_len, fmt, sliding_window, softcap)
    if meta.max_decode_seq_len is not None:
        return None
    assert meta.seq_lens_cpu is not None
    if decode_ok and meta.query_start_loc_cpu == list(range(q.shape[0] + 1)):
        return cuda_turbo.turbo_decode_attention(q, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                                 max(meta.seq_lens_cpu or [1]), fmt, sliding_window, softcap)
    q_lens = meta.query_lens_cpu
    one_token = [s for s, n in enumerate(q_lens) if n == 1] if decode_ok else []
    dense_seqs = [s for s, n in enumerate(q_lens) if n > 1 or (n == 1 and not decode_ok)]
    if dense_seqs:
        dense, tables = _dense_blocks(q.dtype, kv_cache, meta, dense_seqs, fmt)
        if not flash_prefill_supported(q, dense):
            return None
        out = flash_prefill(q, dense, tables, meta.query_start_loc, meta.seq_lens, max(q_lens), scale, sliding_window,
                            softcap, skip_single_token=bool(one_token))
        sdpa_prefill.ROUTES["native"] += 1
    else:
        out = torch.empty_like(q)
    if one_token:
        turbo_decode_rows(q, out, kv_cache, meta, one_token, scale, sliding_window, softcap, fmt)
    return out


def _dense_blocks(
    dtype: torch.dtype, kv_cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int], fmt: TurboFormat
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences ``seqs``' context blocks decoded to a dense cache [2, n, block_size, Hk, D], and block tables
    [S, width] int32 into it (other sequences' rows point at block 0, which the prefill kernel skips for them). The
    index lists are host arithmetic, built once per step; the block ids are gathered on the device."""
    assert meta.block_tables is not None and meta.seq_lens_cpu is not None
    bs = kv_cache.shape[2]
    lens = meta.seq_lens_cpu
    need = {s: (lens[s] + bs - 1) // bs for s in seqs}
    width = max(need.values())
    key = f"turbo_dense{seqs}"
    rows = meta.device_ints(key + "rows", lambda: [s for s in seqs for _ in range(need[s])])
    cols = meta.device_ints(key + "cols", lambda: [c for s in seqs for c in range(need[s])])

    def tables() -> list[int]:
        flat, first = [], 0
        for s in range(meta.num_seqs):
            n = need.get(s, 0)
            flat += list(range(first, first + n)) + [0] * (width - n)
            first += n
        return flat

    dense_tables = meta.device_ints(key + "tables", tables, torch.int32).view(meta.num_seqs, width)
    blocks = meta.block_tables[rows, cols].long()
    return cuda_turbo.blocks_to_dense(kv_cache, blocks, fmt, dtype), dense_tables


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
    assert meta.block_tables is not None and meta.seq_lens_cpu is not None and meta.query_start_loc_cpu is not None
    qsl = meta.query_start_loc_cpu
    tok = meta.device_ints(f"turbo_tok{rows}", lambda: [qsl[s] for s in rows])
    idx = meta.device_ints(f"turbo_seq{rows}", lambda: rows)
    out[tok] = cuda_turbo.turbo_decode_attention(
        q[tok], kv_cache, meta.block_tables.index_select(0, idx).contiguous(), meta.seq_lens.index_select(0, idx),
        scale, max(meta.seq_lens_cpu[s] for s in rows), fmt, sliding_window, softcap,
    )
