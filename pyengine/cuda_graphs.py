"""CUDA graphs of pure-decode steps, one per batch-size bucket, captured at start-up and replayed by the runner.

Why: a decode step of a 32-layer model is ~380 small kernel launches issued from Python; at batch 1 the GPU
waits on the host for more than half of the step. A captured graph replays all of them with one launch.

How: the graphs read static device buffers (token ids, positions, KV slots, context lengths, block tables
padded to the longest context the engine admits). A step with B sequences is copied into the buffers of the
smallest bucket >= B; the padding rows write no K/V (slot -1) and attend to one cached token, and their
outputs are dropped. The paged decode kernel's split-KV grid is fixed at capture by the longest context the
graphs serve (``max_model_len``, at most ``MAX_CAPTURED_CONTEXT``), so one graph serves every shorter context;
steps with a longer context run eagerly (a grid sized for 128k tokens would launch mostly empty CTAs at short
contexts). The logits of every row are computed inside the graph; sampling is not.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.models.base import CausalLM
from candle_vllm.pyengine.ops import cuda, cuda_paged, cuda_turbo
from candle_vllm.pyengine.ops.attention import AttentionMetadata

log = logging.getLogger(__name__)

MAX_CAPTURED_BATCH = 256
MAX_CAPTURED_CONTEXT = 8192


def graph_batch_sizes(max_num_seqs: int, cap: int = MAX_CAPTURED_BATCH) -> list[int]:
    """Buckets 1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256 (powers of two and their midpoints, so a batch
    is padded by at most a third), up to ``min(max_num_seqs, cap)``; that limit itself is always a bucket."""
    limit = max(1, min(max_num_seqs, cap))
    sizes: list[int] = []
    p = 1
    while p <= limit:
        sizes.append(p)
        if p >= 16 and p + p // 2 <= limit:
            sizes.append(p + p // 2)
        p *= 2
    if sizes[-1] != limit:
        sizes.append(limit)
    return sorted(set(sizes))


def unsupported_reason(model: CausalLM, kv_caches: list[torch.Tensor], device: torch.device) -> str | None:
    """Why decode graphs cannot run for this model and cache (None when they can): every op inside must be a
    capture-safe CUDA kernel, and the attention one needs a f16/bf16/e4m3 cache of a supported head geometry."""
    if device.type != "cuda":
        return f"the device is {device}, not CUDA"
    if not cuda.available(device):
        return "candle_vllm._native was built without CUDA kernels (or CANDLE_VLLM_OPS=reference)"
    if not kv_caches:
        return "the model has no KV cache bound"
    cache = kv_caches[0]
    num_heads = getattr(getattr(model, "config", None), "num_heads", None)
    if num_heads is None:
        return f"{type(model).__name__} has no config.num_heads"
    head_dim = getattr(getattr(model, "config", None), "head_dim", cache.shape[-1])
    fmt = TurboFormat.of_cache(cache, head_dim)
    if fmt is not None:
        probe = torch.empty(1, num_heads, head_dim, dtype=torch.bfloat16, device=device)
        if not cuda_turbo.turbo_supported(probe, cache, fmt):
            return f"the TurboQuant decode kernel takes head_dim 64, 128 or 256, not {head_dim}"
        return None
    # An e4m3 cache serves f16/bf16 activations (EngineArgs.cache_torch_dtype refuses it with f32 on CUDA).
    act = torch.bfloat16 if cache.dtype == torch.float8_e4m3fn else cache.dtype
    probe = torch.empty(1, num_heads, cache.shape[-1], dtype=act, device=device)
    if not cuda_paged.paged_decode_supported(probe, cache):
        return (f"the paged decode kernel does not support this cache ({cache.dtype}, head_dim {cache.shape[-1]}, "
                f"{num_heads} query / {cache.shape[3]} KV heads)")
    return None


@dataclass(slots=True)
class _Captured:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bucket, H], written by every replay
    logits: torch.Tensor  # [bucket, V] in the LM head's dtype


class _Inputs(NamedTuple):
    """The static inputs of the decode graphs as views of one int32 buffer, so a step's inputs are one copy:
    ids, positions and slots (int64 [3, n]), then seq_lens [n], then the block tables [n, max_blocks]."""

    buffer: torch.Tensor
    tokens: torch.Tensor
    seq_lens: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def over(cls, buffer: torch.Tensor, n: int, max_blocks: int) -> _Inputs:
        return cls(buffer, buffer[: 6 * n].view(torch.int64).view(3, n), buffer[6 * n : 7 * n],
                   buffer[7 * n :].view(n, max_blocks))

    def prefix(self, rows: int) -> torch.Tensor:
        """The buffer up to the end of the first ``rows`` table rows: what a step of ``rows`` rows must copy."""
        return self.buffer[: self.tables.storage_offset() + rows * self.tables.shape[1]]


@dataclass(slots=True)
class _Staging:
    """Pinned host copies of the static inputs, and the event after the copy that last read them."""

    inputs: _Inputs
    copied: torch.cuda.Event | None = None


class DecodeGraphs:
    """The captured decode graphs of one model and its KV cache, with their static input buffers.

    Not thread-safe; one runner owns it. Replays are queued in call order; the returned outputs are overwritten
    by the next replay, so their consumers (the runner's sampling) must be queued before it.
    """

    def __init__(
        self, model: CausalLM, device: torch.device, max_num_seqs: int, max_model_len: int, block_size: int
    ) -> None:
        self.model = model
        self.device = device
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.max_batch = self.sizes[-1]
        self.max_context = min(max_model_len, MAX_CAPTURED_CONTEXT)
        self.max_blocks = math.ceil(self.max_context / block_size)
        n = self.max_batch
        size = 7 * n + n * self.max_blocks
        self._inputs = _Inputs.over(torch.zeros(size, dtype=torch.int32, device=device), n, self.max_blocks)
        self._tokens, self._seq_lens, self._tables = self._inputs.tokens, self._inputs.seq_lens, self._inputs.tables
        self._qsl = torch.arange(n + 1, dtype=torch.int32, device=device)
        self._tokens[2].fill_(-1)
        self._seq_lens.fill_(1)
        # Two pinned staging sets, used in turn: a step may be staged while the previous step's copy is still
        # queued behind the device's work (the runner launches step N+1 before reading step N back).
        self._staging = [
            _Staging(_Inputs.over(self._inputs.buffer.cpu().pin_memory(), n, self.max_blocks)) for _ in range(2)
        ]
        self._turn = 0
        self._graphs: dict[int, _Captured] = {}

    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool (smaller graphs reuse its blocks)."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                self._forward(size)  # warm-up outside capture: skinny-GEMM counters, cuBLAS handles and workspaces
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    hidden, logits = self._forward(size)
                self._graphs[size] = _Captured(graph, hidden, logits)
        torch.cuda.synchronize(self.device)
        log.info("CUDA graphs: captured decode steps for batch sizes %s (contexts up to %d) in %.1f s",
                 self.sizes, self.max_context, time.perf_counter() - t0)

    def _forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = AttentionMetadata(
            query_start_loc=self._qsl[: size + 1],
            seq_lens=self._seq_lens[:size],
            slot_mapping=self._tokens[2, :size],
            block_tables=self._tables[:size],
            query_start_loc_cpu=list(range(size + 1)),
            max_decode_seq_len=self.max_context,
        )
        hidden = self.model(self._tokens[0, :size], self._tokens[1, :size], meta)
        return hidden, self.model.compute_logits(hidden, f32=False)

    def bucket_for(self, num_seqs: int, max_seq_len: int, table_width: int) -> int | None:
        """The captured batch size that serves ``num_seqs`` decode rows whose longest context is ``max_seq_len``
        and block tables ``table_width`` wide, or None when no graph does."""
        if (not self._graphs or num_seqs > self.max_batch or max_seq_len > self.max_context
                or table_width > self.max_blocks):
            return None
        return next(s for s in self.sizes if s >= num_seqs)

    def run(
        self,
        bucket: int,
        input_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the ``bucket`` graph for B = len(seq_lens) decode rows; returns views (hidden [B, H], logits
        [B, V] in the LM head's dtype) of its outputs, valid until the next call. ``input_ids`` may be a device tensor (ids gathered on
        the device from a step not yet read back): it is copied device to device, never through the host."""
        b = seq_lens.shape[0]
        staging = self._staging[self._turn]
        self._turn ^= 1
        if staging.copied is not None:
            staging.copied.synchronize()  # its copies of two steps ago have run: free to overwrite
        tokens = staging.inputs.tokens.numpy()
        tokens[0, :b] = 0 if isinstance(input_ids, torch.Tensor) else input_ids
        tokens[1, :b], tokens[2, :b] = positions, slot_mapping
        tokens[:2, b:bucket] = 0
        tokens[2, b:bucket] = -1  # padding rows write no K/V
        lens = staging.inputs.seq_lens.numpy()
        lens[:b] = seq_lens
        lens[b:bucket] = 1  # padding rows attend to one token of whatever block their (stale, valid) table names
        staging.inputs.tables.numpy()[:b, : block_tables.shape[1]] = block_tables
        self._inputs.prefix(bucket).copy_(staging.inputs.prefix(bucket), non_blocking=True)  # one copy per step
        if staging.copied is None:
            staging.copied = torch.cuda.Event()
        staging.copied.record()
        if isinstance(input_ids, torch.Tensor):
            self._tokens[0, :b].copy_(input_ids)
        captured = self._graphs[bucket]
        captured.graph.replay()
        return captured.hidden[:b], captured.logits[:b]
