"""Paged decode cases shared by the attention tests: a cache with scattered blocks, and float64 attention over
the gathered K/V as the reference."""

from __future__ import annotations

import math

import torch

DEV = torch.device("cuda")
E4M3_MAX = 448.0  # the largest finite e4m3 value


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """x as an e4m3 cache stores it: saturated at +-448, torch's float8 cast as the rounding oracle."""
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def paged_case(seq_lens: list[int], hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype, seed: int,
               kv_dtype: torch.dtype | None = None):
    """q [B, hq, d] of ``dtype``, a cache of ``kv_dtype`` (default ``dtype``; an e4m3 one also holds a few values
    near 100, so more than the unit binade is read), its block table and the blocks of each sequence."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    cache = torch.randn(2, num_blocks, block_size, hk, d, generator=g, device=DEV)
    if kv_dtype == torch.float8_e4m3fn:
        cache = e4m3(cache * torch.where(torch.rand(cache.shape, generator=g, device=DEV) < 0.002, 40.0, 1.0))
    else:
        cache = cache.to(kv_dtype or dtype)
    perm = torch.randperm(num_blocks, generator=g, device=DEV).tolist()  # blocks scattered over the cache
    tables, pos = [], 0
    for n in need:
        tables.append(perm[pos : pos + n])
        pos += n
    width = max(need) + 1
    table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEV)
    q = torch.randn(len(seq_lens), hq, d, generator=g, device=DEV).to(dtype)
    return q, cache, table_t, tables


def reference(q, cache, tables, seq_lens, scale, window=None, softcap=None) -> torch.Tensor:
    """Float64 attention of each sequence's one query over its gathered context (an e4m3 cache read as the
    values it holds)."""
    if cache.dtype == torch.float8_e4m3fn:
        cache = cache.float()
    hq, hk = q.shape[1], cache.shape[3]
    out = []
    for b, (table, ctx) in enumerate(zip(tables, seq_lens, strict=True)):
        kv = cache[:, table].flatten(1, 2)[:, :ctx].double()  # [2, ctx, hk, d]
        k = kv[0].repeat_interleave(hq // hk, dim=1)
        v = kv[1].repeat_interleave(hq // hk, dim=1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        if window:
            s[:, : max(0, ctx - window)] = float("-inf")
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(out)
