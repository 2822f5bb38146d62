"""Attention over a flattened token batch, with or without a paged KV cache (torch reference).

All sequences of a step are packed into one batch of T new tokens (vLLM v1 style); ``AttentionMetadata``
says where each sequence's tokens start and how long its context is. Chunked prefill and decode are one
code path: a query at absolute position p attends to its sequence's keys at positions <= p (and > p -
sliding_window when set). On the torch reference, decode rows (one new token each) are batched into a single
padded call and longer query runs go one sequence at a time so a long prefill never pads the others; on CUDA
(f16/bf16) a step with prefill rows runs the flash prefill kernel once (``ops/cuda_prefill.py``), its decode rows
the paged decode kernel; with ``CANDLE_VLLM_PREFILL=sdpa-cudnn|sdpa-flash`` the rows of fresh prompts (no cached
prefix) take torch's cuDNN/flash kernel instead (``ops/sdpa_prefill.py``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from candle_vllm.pyengine.ops import cuda, native, sdpa_prefill
from candle_vllm.pyengine.ops.cuda_prefill import flash_prefill, flash_prefill_supported
from candle_vllm.pyengine.ops.transfer import to_device


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and how they reach the KV cache."""

    query_start_loc: torch.Tensor  # int32 [S+1], cumulative new-token counts
    seq_lens: torch.Tensor  # int32 [S], context length after this step (cached + new)
    slot_mapping: torch.Tensor | None = None  # int64 [T], block_id * block_size + offset per new token
    block_tables: torch.Tensor | None = None  # int32 [S, max_blocks]
    query_start_loc_cpu: list[int] | None = None  # host copies, so CPU code needs no device syncs
    seq_lens_cpu: list[int] | None = None
    # Set for a pure decode batch (one new token per sequence) whose contexts are all <= this: the CUDA decode
    # path then needs no host copy of seq_lens (which a CUDA graph could not refresh between replays).
    max_decode_seq_len: int | None = None

    def __post_init__(self) -> None:
        if self.query_start_loc_cpu is None:
            self.query_start_loc_cpu = self.query_start_loc.tolist()
        if self.seq_lens_cpu is None and self.max_decode_seq_len is None:
            self.seq_lens_cpu = self.seq_lens.tolist()

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @functools.cached_property
    def query_lens_cpu(self) -> list[int]:
        """New tokens per sequence (host), computed once per step rather than once per layer."""
        qsl = self.query_start_loc_cpu or []
        return [b - a for a, b in itertools.pairwise(qsl)]

    @functools.cached_property
    def fresh_runs(self) -> list[sdpa_prefill.FreshRun]:
        """Runs of consecutive sequences with no cached prefix (their K/V are all this step's own), computed once
        per step: the rows a dense attention kernel can take (``ops/sdpa_prefill.py``)."""
        return sdpa_prefill.fresh_runs(self.query_start_loc_cpu or [], self.seq_lens_cpu or [])

    def device_ints(self, key: str, values: Callable[[], Sequence[int]], dtype: torch.dtype = torch.int64
                    ) -> torch.Tensor:
        """The integers ``values()`` on the step's device, built and copied once per step under ``key`` (every
        layer reuses them) and queued without a host wait: a plain ``torch.tensor(..., device=cuda)`` from pageable
        memory synchronizes with the stream, which would drain the GPU once per layer."""
        cache: dict[str, torch.Tensor] = self.__dict__.setdefault("_device_ints", {})
        if key not in cache:
            cache[key] = to_device(torch.tensor(values(), dtype=dtype), self.seq_lens.device)
        return cache[key]

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        seq_lens: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        block_tables: Sequence[Sequence[int]] | None = None,
        block_size: int | None = None,
    ) -> AttentionMetadata:
        """Metadata from host lists. Without ``block_tables`` the batch has no cache (seq_lens = query_lens);
        with them, slot_mapping places each new token at its absolute position in its sequence's blocks."""
        seq_lens = list(query_lens) if seq_lens is None else list(seq_lens)
        if len(seq_lens) != len(query_lens) or any(q > s for q, s in zip(query_lens, seq_lens, strict=True)):
            raise ValueError(f"each query length must be <= its sequence length: {query_lens} vs {seq_lens}")
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        slot_mapping = tables = None
        if block_tables is not None:
            if block_size is None:
                raise ValueError("block_size is required with block_tables")
            slots = [
                table[pos // block_size] * block_size + pos % block_size
                for table, q, s in zip(block_tables, query_lens, seq_lens, strict=True)
                for pos in range(s - q, s)
            ]
            width = max(len(t) for t in block_tables)
            padded = [list(t) + [0] * (width - len(t)) for t in block_tables]
            slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
            tables = torch.tensor(padded, dtype=torch.int32, device=device)
        return cls(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            slot_mapping=slot_mapping,
            block_tables=tables,
            query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens,
        )


def write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hk, D] into a cache [2, num_blocks, block_size, Hk, D] at flat slots [T]."""
    _, _, _, hk, d = kv_cache.shape
    flat = kv_cache.view(2, -1, hk, d)
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


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


def _gather_context(kv_cache: torch.Tensor, table: torch.Tensor, ctx: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [ctx, Hk, D] of one sequence, read through its block table."""
    bs = kv_cache.shape[2]
    blocks = kv_cache[:, table[: (ctx + bs - 1) // bs].long()]
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
    says a fused kernel already stored them) and queries read their whole context through
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
        if on_cuda and k.dtype == v.dtype == kv_cache.dtype and not kv_cached:
            cuda.reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        elif not kv_cached:
            write_kv(k, v, kv_cache, meta.slot_mapping)
        if _native_paged_ready(q, kv_cache, meta):
            return _native_paged_attention(q, kv_cache, meta, scale, num_kv_heads, sliding_window, softcap)
        cuda_decode = on_cuda and cuda.paged_decode_supported(q, kv_cache)
        if meta.max_decode_seq_len is not None:
            if not cuda_decode:
                raise ValueError(
                    "max_decode_seq_len (a decode batch without host seq_lens, as CUDA graphs run it) needs the CUDA "
                    "paged decode kernel (f16/bf16 cache, supported head geometry); build the metadata with "
                    "seq_lens_cpu instead"
                )
            return cuda.paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, meta.max_decode_seq_len, sliding_window, softcap
            )
        if cuda_decode and meta.query_start_loc_cpu == list(range(t + 1)):  # a pure decode step
            return cuda.paged_decode_attention(
                q, kv_cache, meta.block_tables, meta.seq_lens, scale, max(meta.seq_lens_cpu or [1]), sliding_window,
                softcap,
            )
        if on_cuda and flash_prefill_supported(q, kv_cache):
            backend = sdpa_prefill.prefill_backend()
            if sdpa_prefill.sdpa_eligible(backend, q, k, v, sliding_window, softcap) and meta.fresh_runs:
                return _sdpa_prefill_step(backend, q, k, v, kv_cache, meta, scale, cuda_decode)
            return _cuda_prefill_step(q, kv_cache, meta, scale, sliding_window, softcap, cuda_decode)
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
            ks, vs = _gather_context(kv_cache, meta.block_tables[s], ctx)
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


def _cuda_prefill_step(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
    cuda_decode: bool,
) -> torch.Tensor:
    """A CUDA step with prefill rows: every multi-token sequence through the flash prefill kernel in one launch;
    one-token sequences through the paged decode kernel when it takes this geometry (it shares each K/V read
    across a GQA group), else as one-row queries of the flash kernel."""
    assert meta.block_tables is not None and meta.query_start_loc_cpu is not None and meta.seq_lens_cpu is not None
    q_lens = meta.query_lens_cpu
    decode_rows = [s for s, n in enumerate(q_lens) if n == 1] if cuda_decode else []
    out = flash_prefill(
        q, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(q_lens, default=1), scale,
        sliding_window, softcap, skip_single_token=bool(decode_rows),
    )
    sdpa_prefill.ROUTES["native"] += 1
    if decode_rows:
        _decode_rows_cuda(q, out, kv_cache, meta, decode_rows, scale, sliding_window, softcap)
    return out


def _decode_rows_cuda(
    q: torch.Tensor,
    out: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    scale: float,
    sliding_window: int | None,
    softcap: float | None,
) -> None:
    """The one-token sequences ``rows`` of a prefill step through the paged decode kernel, into ``out``."""
    assert meta.block_tables is not None and meta.query_start_loc_cpu is not None and meta.seq_lens_cpu is not None
    qsl = meta.query_start_loc_cpu
    tok = meta.device_ints(f"decode_tok{rows}", lambda: [qsl[s] for s in rows])
    idx = meta.device_ints(f"decode_seq{rows}", lambda: rows)
    out[tok] = cuda.paged_decode_attention(
        q[tok], kv_cache, meta.block_tables[idx], meta.seq_lens[idx], scale, max(meta.seq_lens_cpu[s] for s in rows),
        sliding_window, softcap,
    )


def _sdpa_prefill_step(
    backend: str,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    cuda_decode: bool,
) -> torch.Tensor:
    """A CUDA step whose fresh prompts take torch's ``backend`` (their K/V are the step's own k/v, already in the
    cache for later steps); the other multi-token sequences (cached prefix) run our flash kernel on their gathered
    rows, one-token sequences the decode kernel (or our flash kernel when the decode kernel lacks the geometry).
    No sliding window or soft-cap reaches here (``sdpa_eligible``)."""
    assert meta.block_tables is not None and meta.query_start_loc_cpu is not None
    runs = meta.fresh_runs
    if backend == "sdpa-cudnn" and not all(sdpa_prefill.cudnn_supported(q, k, v, r) for r in runs):
        return _cuda_prefill_step(q, kv_cache, meta, scale, None, None, cuda_decode)
    t = q.shape[0]
    if len(runs) == 1 and runs[0].start == 0 and runs[0].end == t:  # only fresh prompts (the TTFT step)
        chosen = sdpa_prefill.run_backend(backend, q, k, v, runs[0])
        sdpa_prefill.ROUTES[chosen] += 1
        return sdpa_prefill.attend_fresh(chosen, q, k, v, runs[0], scale).contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for run in runs:
        chosen = sdpa_prefill.run_backend(backend, q, k, v, run)
        out[run.start : run.end] = sdpa_prefill.attend_fresh(chosen, q, k, v, run, scale)
        sdpa_prefill.ROUTES[chosen] += 1
    fresh = {s for r in runs for s in range(r.first, r.last)}
    q_lens = meta.query_lens_cpu
    decode_rows = [s for s, n in enumerate(q_lens) if n == 1 and s not in fresh] if cuda_decode else []
    rest = [s for s, n in enumerate(q_lens) if n > 0 and s not in fresh and s not in decode_rows]
    if rest:
        _native_rows(q, out, kv_cache, meta, rest, scale)
    if decode_rows:
        _decode_rows_cuda(q, out, kv_cache, meta, decode_rows, scale, None, None)
    return out


def _native_rows(
    q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int],
    scale: float,
) -> None:
    """Sequences ``seqs`` of the step through our flash prefill kernel, their query rows gathered into one batch."""
    assert meta.block_tables is not None and meta.query_start_loc_cpu is not None
    qsl = meta.query_start_loc_cpu
    rows = meta.device_ints(f"native_rows{seqs}", lambda: [r for s in seqs for r in range(qsl[s], qsl[s + 1])])
    lens = [qsl[s + 1] - qsl[s] for s in seqs]
    idx = meta.device_ints(f"native_seqs{seqs}", lambda: seqs)
    sub_qsl = meta.device_ints(f"native_qsl{seqs}", lambda: list(itertools.accumulate(lens, initial=0)), torch.int32)
    got = flash_prefill(
        q.index_select(0, rows), kv_cache, meta.block_tables.index_select(0, idx), sub_qsl,
        meta.seq_lens.index_select(0, idx), max(lens), scale,
    )
    sdpa_prefill.ROUTES["native"] += 1
    out.index_copy_(0, rows, got)


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
    kv = kv_cache[:, tables].flatten(2, 3).to(q.dtype)  # [2, B, n_blocks*bs, Hk, D]
    tok = torch.tensor([meta.query_start_loc_cpu[s] for s in rows], device=q.device)
    k_len = torch.tensor(ctx, device=q.device)
    mask = _mask((k_len - 1).unsqueeze(1), k_len, kv.shape[2], sliding_window)
    out[tok] = _attend(q[tok].unsqueeze(1), kv[0], kv[1], mask, scale, softcap)[:, 0]


def _native_paged_ready(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    assert meta.block_tables is not None
    return (
        q.device.type == "cpu"
        and q.dtype == kv_cache.dtype
        and native.ready(q, kv_cache)
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
    """The CPU kernel: each (token, head) alone with an online softmax, so results are batch invariant."""
    assert meta.block_tables is not None
    t, hq, d = q.shape
    out = torch.empty_like(q)
    native.module().cpu_paged_attention(
        native.ptr(out), native.ptr(q), native.ptr(kv_cache), native.ptr(meta.block_tables),
        native.ptr(meta.query_start_loc), native.ptr(meta.seq_lens), meta.seq_lens.shape[0], t, hq, num_kv_heads, d,
        kv_cache.shape[2], kv_cache.shape[1], meta.block_tables.shape[1], scale, sliding_window or 0, softcap or 0.0,
        native.dtype_code(q),
    )
    return out
