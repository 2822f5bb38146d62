"""Where each sequence's new tokens sit in a step's flat batch and how they reach the paged KV cache.

Built once per step by the runner (or :meth:`AttentionMetadata.build` in tests) and read by every layer's attention,
so anything derived from it (host lists, fresh-prompt runs, index tensors on the device) is computed once per step.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from candle_vllm.pyengine.ops import sdpa_prefill
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
