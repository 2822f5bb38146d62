"""CUDA steps with prefill rows: our flash prefill kernel over the paged cache, or torch's cuDNN/flash attention
for fresh prompts (``ops/sdpa_prefill.py``), with the step's one-token rows on the paged decode kernel."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from candle_vllm.pyengine.ops import cuda_paged, sdpa_prefill
from candle_vllm.pyengine.ops.attention_metadata import AttentionMetadata
from candle_vllm.pyengine.ops.cuda_prefill import flash_prefill


def cuda_prefill_step(
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


def decode_rows_into(
    out: torch.Tensor,
    q: torch.Tensor,
    meta: AttentionMetadata,
    rows: list[int],
    decode: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> None:
    """The one-token sequences ``rows`` of a step with prefill rows through a paged decode kernel,
    ``decode(q_rows, block_tables, seq_lens, longest_context)``, into ``out``."""
    assert meta.block_tables is not None and meta.query_start_loc_cpu is not None and meta.seq_lens_cpu is not None
    qsl = meta.query_start_loc_cpu
    tok = meta.device_ints(f"decode_tok{rows}", lambda: [qsl[s] for s in rows])
    idx = meta.device_ints(f"decode_seq{rows}", lambda: rows)
    tables, lens = meta.block_tables.index_select(0, idx), meta.seq_lens.index_select(0, idx)
    # q's gather goes last: the decode kernels (programmatic dependents, common.cuh) read tables and lengths before
    # they wait on the kernel just before them, q only after.
    out[tok] = decode(q[tok], tables, lens, max(meta.seq_lens_cpu[s] for s in rows))


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
    decode_rows_into(out, q, meta, rows, lambda qr, tables, lens, longest: cuda_paged.paged_decode_attention(
        qr, kv_cache, tables, lens, scale, longest, sliding_window, softcap))


def sdpa_prefill_step(
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
    fresh = attend_fresh_runs(backend, q, k, v, meta, scale)
    if fresh is None:
        return cuda_prefill_step(q, kv_cache, meta, scale, None, None, cuda_decode)
    out, done = fresh
    q_lens = meta.query_lens_cpu
    decode_rows = [s for s, n in enumerate(q_lens) if n == 1 and s not in done] if cuda_decode else []
    rest = [s for s, n in enumerate(q_lens) if n > 0 and s not in done and s not in decode_rows]
    if rest:
        native_rows(q, out, kv_cache, meta, rest, scale)
    if decode_rows:
        _decode_rows_cuda(q, out, kv_cache, meta, decode_rows, scale, None, None)
    return out


def attend_fresh_runs(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, scale: float,
) -> tuple[torch.Tensor, set[int]] | None:
    """The step's fresh prompts (``meta.fresh_runs``) through torch's ``backend`` over the step's own k/v: out
    [T, Hq, D] with their rows filled, and the set of those sequences; None when ``backend`` is cuDNN and it cannot
    take one of them."""
    assert meta.query_start_loc_cpu is not None
    runs = meta.fresh_runs
    if backend == "sdpa-cudnn" and not all(sdpa_prefill.cudnn_supported(q, k, v, r) for r in runs):
        return None
    done = {s for r in runs for s in range(r.first, r.last)}
    if len(runs) == 1 and runs[0].start == 0 and runs[0].end == q.shape[0]:  # only fresh prompts (the TTFT step)
        chosen = sdpa_prefill.run_backend(backend, q, k, v, runs[0])
        sdpa_prefill.ROUTES[chosen] += 1
        return sdpa_prefill.attend_fresh(chosen, q, k, v, runs[0], scale).contiguous(), done
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    for run in runs:
        chosen = sdpa_prefill.run_backend(backend, q, k, v, run)
        out[run.start : run.end] = sdpa_prefill.attend_fresh(chosen, q, k, v, run, scale)
        sdpa_prefill.ROUTES[chosen] += 1
    return out, done


def native_rows(
    q: torch.Tensor, out: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, seqs: list[int],
    scale: float, block_tables: torch.Tensor | None = None,
) -> None:
    """Sequences ``seqs`` of the step through our flash prefill kernel, their query rows gathered into one batch,
    reading ``kv_cache`` through ``block_tables`` [S, width] (default: the step's own)."""
    assert meta.block_tables is not None and meta.query_start_loc_cpu is not None
    qsl = meta.query_start_loc_cpu
    rows = meta.device_ints(f"native_rows{seqs}", lambda: [r for s in seqs for r in range(qsl[s], qsl[s + 1])])
    lens = [qsl[s + 1] - qsl[s] for s in seqs]
    idx = meta.device_ints(f"native_seqs{seqs}", lambda: seqs)
    sub_qsl = meta.device_ints(f"native_qsl{seqs}", lambda: list(itertools.accumulate(lens, initial=0)), torch.int32)
    tables = meta.block_tables if block_tables is None else block_tables
    got = flash_prefill(
        q.index_select(0, rows), kv_cache, tables.index_select(0, idx), sub_qsl,
        meta.seq_lens.index_select(0, idx), max(lens), scale,
    )
    sdpa_prefill.ROUTES["native"] += 1
    out.index_copy_(0, rows, got)
