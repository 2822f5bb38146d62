"""Attention over a flattened token batch, with or without a paged KV cache (torch reference).

All sequences of a step are packed into one batch of T new tokens (vLLM v1 style); ``AttentionMetadata``
says where each sequence's tokens start and how long its context is. Chunked prefill and decode are one
code path: a query at absolute position p attends to its sequence's keys at positions <= p (and > p -
sliding_window when set). On the torch reference, decode rows (one new token each) are batched into a single
padded call and longer query runs go one sequence at a time so a long prefill never pads the others; on CUDA
(f16/bf16 activations, a cache of their dtype or e4m3) a step with prefill rows runs the flash prefill kernel once
(``ops/cuda_prefill.py``), its decode rows the paged decode kernel; the rows of fresh prompts (no cached prefix)
may take torch's cuDNN/flash kernel instead (``ops/sdpa_prefill.py``, ``CANDLE_VLLM_PREFILL``), given the K/V
values an e4m3 cache holds so that every route attends to the same values. A TurboQuant cache
(``kv_cache/turbo.py``) is written and read by its own kernels on CUDA (``ops/attention_turbo.py``: decode rows on
its decode kernel, prefill rows on the flash prefill kernel over blocks decoded to dense) and by the native
paged-attention kernel on the CPU; the torch reference rotates the queries as its keys were.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.kv_cache import turbo
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda, cuda_paged, cuda_turbo, native, sdpa_prefill
from candle_vllm.pyengine.ops.attention_cuda import cuda_prefill_step, sdpa_prefill_step
from candle_vllm.pyengine.ops.attention_metadata import AttentionMetadata
from candle_vllm.pyengine.ops.attention_turbo import turbo_step
from candle_vllm.pyengine.ops.cuda_prefill import flash_prefill_supported

__all__ = ["AttentionMetadata", "attention", "write_kv"]


E4M3_MAX = 448.0  # the largest finite e4m3 value: an e4m3 cache saturates there


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x as a cache of ``dtype`` stores it: an e4m3 cache saturates at +-448 and rounds to nearest even, as the
    CUDA cache writes do (``native/cuda/fp8_kv.cuh``)."""
    if dtype == torch.float8_e4m3fn:
        return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(dtype)
    return x.to(dtype)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hk, D] into a cache [2, num_blocks, block_size, Hk, D] (or a TurboQuant one) at
    flat slots [T]."""
    fmt = TurboFormat.of_cache(kv_cache, k.shape[-1])
    if fmt is not None:
        turbo.write(k, v, kv_cache, slot_mapping, fmt)
        return
    _, _, _, hk, d = kv_cache.shape
    as_bytes = kv_cache.dtype == torch.float8_e4m3fn  # torch has no index_copy_ for float8: move the bytes
    flat = kv_cache.view(torch.uint8).view(2, -1, hk, d) if as_bytes else kv_cache.view(2, -1, hk, d)
    for half, x in ((flat[0], k), (flat[1], v)):
        stored = to_cache_dtype(x, kv_cache.dtype)
        half.index_copy_(0, slot_mapping, stored.view(torch.uint8) if as_bytes else stored)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """q [B, Lq, Hq, D], k/v [B, Lk, Hk, D], mask [B, Lq, Lk] (True = attend) -> [B, Lq, Hq, D].

    GQA without copying K/V: the query heads sharing a KV head are folded into the query-length axis.
    """
    b, lq, hq, d = q.shape
    hk, lk = k.shape[2], k.shape[1]
    g = hq // hk
    qg = q.view(b, lq, hk, g, d).permute(0, 2, 3, 1, 4).reshape(b, hk, g * lq, d)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)
    m = mask.unsqueeze(1).unsqueeze(1).expand(b, 1, g, lq, lk).reshape(b, 1, g * lq, lk)
    if softcap is None:
        out = F.scaled_dot_product_attention(qg, kt, vt, attn_mask=m, scale=scale)
    else:
        scores = (qg @ kt.transpose(-1, -2)).float() * scale
        scores = softcap * torch.tanh(scores / softcap)
        probs = scores.masked_fill(~m, float("-inf")).softmax(-1).to(vt.dtype)
        out = probs @ vt
    return out.view(b, hk, g, lq, d).permute(0, 3, 1, 2, 4).reshape(b, lq, hq, d)


def _mask(
    q_pos: torch.Tensor, k_len: torch.Tensor, max_k: int, sliding_window: int | None
) -> torch.Tensor:
    """[B, Lq, Lk] causal-by-position mask; q_pos [B, Lq] absolute positions, k_len [B] valid keys."""
    kp = torch.arange(max_k, device=q_pos.device).view(1, 1, -1)
    qp = q_pos.unsqueeze(-1)
    m = (kp <= qp) & (kp < k_len.view(-1, 1, 1))
    if sliding_window is not None:
        m &= kp > qp - sliding_window
    return m


def _blocks(kv_cache: torch.Tensor, index: torch.Tensor, head_dim: int) -> torch.Tensor:
    """``kv_cache[:, index]``; an e4m3 cache is indexed as bytes (float8 indexing is missing from some torch
    builds and devices), a TurboQuant one decoded to f32 (its keys rotated)."""
    fmt = TurboFormat.of_cache(kv_cache, head_dim)
    if fmt is not None:
        return turbo.read_blocks(kv_cache, index, fmt)
    if kv_cache.dtype == torch.float8_e4m3fn:
        return kv_cache.view(torch.uint8)[:, index].view(kv_cache.dtype)
    return kv_cache[:, index]


def _gather_context(
    kv_cache: torch.Tensor, table: torch.Tensor, ctx: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [ctx, Hk, D] of one sequence, read through its block table."""
    bs = kv_cache.shape[2]
    blocks = _blocks(kv_cache, table[: (ctx + bs - 1) // bs].long(), head_dim)
    kv = blocks.flatten(1, 2)[:, :ctx]
    return kv[0], kv[1]


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    num_kv_heads: int,
    sliding_window: int | None = None,
    softcap: float | None = None,
    kv_cached: bool = False,
) -> torch.Tensor:
    """Causal attention for a flat batch: q [T, Hq*D or Hq, D], k/v [T, Hk, D] -> [T, Hq, D].

    With ``kv_cache`` and ``meta.slot_mapping`` the new K/V are written to the cache first (unless ``kv_cached``
    says a fused kernel already stored them; into a TurboQuant cache that kernel also leaves k/v as the rows
    decode to, as ``cuda_turbo.rope_cache_write_`` does) and queries read their whole context through
    ``meta.block_tables``; otherwise each sequence attends within its new tokens.
    """
    t, d = k.shape[0], k.shape[-1]
    if k.shape[1] != num_kv_heads:
        raise ValueError(f"k has {k.shape[1]} heads, expected num_kv_heads={num_kv_heads}")
    q = q.view(t, -1, d)
    paged = kv_cache is not None and meta.slot_mapping is not None
    on_cuda = q.device.type == "cuda" and cuda.available(q.device)
    if paged:
        assert kv_cache is not None and meta.slot_mapping is not None and meta.block_tables is not None
        fmt = TurboFormat.of_cache(kv_cache, d)
        if on_cuda and fmt is not None and cuda_turbo.turbo_supported(q, kv_cache, fmt):
            fresh = None
            if meta.max_decode_seq_len is None and meta.fresh_runs and cuda_turbo.decode_supported(q, kv_cache, fmt):
                backend = sdpa_prefill.prefill_backend()  # read only for steps with fresh prompts, not every decode
                if sdpa_prefill.sdpa_eligible(backend, q, k, v, sliding_window, softcap):
                    fresh = (backend, k, v)  # k/v as the rows decode to: written so below, or by the RoPE kernel
            if not kv_cached:
                cuda_turbo.turbo_cache_write(k, v, kv_cache, meta.slot_mapping, fmt, round_trip=fresh is not None)
                kv_cached = True
            out = turbo_step(q, kv_cache, meta, scale, sliding_window, softcap, fmt, fresh)
            if out is not None:
                return out
        if on_cuda and k.dtype == v.dtype and cuda.cache_holds(kv_cache, k.dtype) and not kv_cached:
            cuda_paged.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        elif not kv_cached:
            write_kv(k, v, kv_cache, meta.slot_mapping)
        if _native_paged_ready(q, kv_cache, meta):
            return _native_paged_attention(q, kv_cache, meta, scale, num_kv_heads, sliding_window, softcap)
        if fmt is not None and fmt.rotated:  # the cached keys are rotated: scores need the queries rotated alike
            q = turbo.rotate(q).to(q.dtype)
        cuda_decode = on_cuda and cuda_paged.paged_decode_supported(q, kv_cache)
        if meta.max_decode_seq_len is not None:
            if not cuda_decode:
                raise ValueError(
                    "max_decode_seq_len (a decode batch without host seq_lens, as CUDA graphs run it) needs the CUDA "
                    "paged decode kernel (f16/bf16 q, a cache of q's dtype or e4m3, supported head geometry); build "
                    "the metadata with "
                    "seq_lens_cpu instead"
                )
            return cuda_paged.paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, meta.max_decode_seq_len, sliding_window, softcap
            )
        if cuda_decode and meta.query_start_loc_cpu == list(range(t + 1)):  # a pure decode step
            return cuda_paged.paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, max(meta.seq_lens_cpu or [1]), sliding_window,
                softcap,
            )
        if on_cuda and flash_prefill_supported(q, kv_cache):
            backend = sdpa_prefill.prefill_backend()
            if sdpa_prefill.sdpa_eligible(backend, q, k, v, sliding_window, softcap) and meta.fresh_runs:
                if kv_cache.dtype != k.dtype:  # torch's kernels read k/v, not the cache: give them its values
                    cuda_paged.round_to_e4m3_(k, v)
                return sdpa_prefill_step(backend, q, k, v, kv_cache, meta, scale, cuda_decode)
            return cuda_prefill_step(q, kv_cache, meta, scale, sliding_window, softcap, cuda_decode)
    qsl, lens = meta.query_start_loc_cpu or [], meta.seq_lens_cpu or []
    out = torch.empty_like(q)
    decode_rows: list[int] = []
    for s in range(len(lens)):
        start, end = qsl[s], qsl[s + 1]
        q_len, ctx = end - start, lens[s] if paged else end - start
        if q_len == 0:
            continue
        if paged and q_len == 1:
            decode_rows.append(s)
            continue
        if paged:
            assert kv_cache is not None and meta.block_tables is not None
            ks, vs = _gather_context(kv_cache, meta.block_tables[s], ctx, d)
        else:
            ks, vs = k[start:end], v[start:end]
        q_pos = torch.arange(ctx - q_len, ctx, device=q.device).unsqueeze(0)
        mask = _mask(q_pos, torch.tensor([ctx], device=q.device), ctx, sliding_window)
        out[start:end] = _attend(
            q[start:end].unsqueeze(0), ks.to(q.dtype).unsqueeze(0), vs.to(q.dtype).unsqueeze(0), mask, scale, softcap
        )[0]
    if decode_rows:
        assert kv_cache is not None
        _decode_batch(q, out, kv_cache, meta, decode_rows, scale, sliding_window, softcap)
    return out


def _decode_batch(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """All single-token sequences in one padded call: keys gathered up to the longest context."""
    assert meta.block_tables is not None and meta.seq_lens_cpu is not None and meta.query_start_loc_cpu is not None
    bs = kv_cache.shape[2]
    ctx = [meta.seq_lens_cpu[s] for s in rows]
    n_blocks = (max(ctx) + bs - 1) // bs
    idx = torch.tensor(rows, device=q.device)
    tables = meta.block_tables.index_select(0, idx)[:, :n_blocks].long()
    kv = _blocks(kv_cache, tables, q.shape[-1]).flatten(2, 3).to(q.dtype)  # [2, B, n_blocks*bs, Hk, D]
    tok = torch.tensor([meta.query_start_loc_cpu[s] for s in rows], device=q.device)
    k_len = torch.tensor(ctx, device=q.device)
    mask = _mask((k_len - 1).unsqueeze(1), k_len, kv.shape[2], sliding_window)
    out[tok] = _attend(q[tok].unsqueeze(1), kv[0], kv[1], mask, scale, softcap)[:, 0]


def _native_paged_ready(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    assert meta.block_tables is not None
    return (
        q.device.type == "cpu"
        and kv_cache.dtype in (q.dtype, torch.float8_e4m3fn, torch.uint8)
        and native.ready(q)
        and native.ready(kv_cache, dtypes=(kv_cache.dtype,))
        and native.ready(meta.block_tables, meta.query_start_loc, meta.seq_lens, dtypes=(torch.int32,))
    )


def _native_paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_kv_heads: int,
    sliding_window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """The CPU kernel: each (token, head) alone with an online softmax, so results are batch invariant. It reads
    TurboQuant rows itself, rotating each query as their keys were."""
    assert meta.block_tables is not None
    t, hq, d = q.shape
    out = torch.empty_like(q)
    fmt = TurboFormat.of_cache(kv_cache, d)
    signs = turbo.channel_signs(d) if fmt is not None and fmt.rotated else None
    native.loaded().cpu_paged_attention(
        native.ptr(out), native.ptr(q), native.ptr(kv_cache), native.ptr(meta.block_tables),
        native.ptr(meta.query_start_loc), native.ptr(meta.seq_lens), meta.seq_lens.shape[0], t, hq, num_kv_heads, d,
        kv_cache.shape[2], kv_cache.shape[1], meta.block_tables.shape[1], scale, sliding_window or 0, softcap or 0.0,
        native.dtype_code(q), native.dtype_code(kv_cache), 0 if fmt is None else fmt.k_bits,
        0 if signs is None else native.ptr(signs),
    )
    return out
