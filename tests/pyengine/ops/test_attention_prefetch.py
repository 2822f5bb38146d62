"""How many bytes of the next GEMM's weights the decode attention warms in L2 (ops/cuda_paged.py)."""

from __future__ import annotations

import pytest
import torch

from candle_vllm.pyengine.ops import cuda_paged


def test_small_batches_only_and_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    w = torch.empty(3 * 2**20 + 5, dtype=torch.bfloat16)  # 6 MiB + 10 bytes
    monkeypatch.delenv(cuda_paged.PREFETCH_ENV, raising=False)
    assert cuda_paged.attention_prefetch_bytes(1, w) == (w.numel() * 2) // 16 * 16
    assert cuda_paged.attention_prefetch_bytes(cuda_paged.PREFETCH_MAX_SEQS + 1, w) == 0
    assert cuda_paged.attention_prefetch_bytes(1, None) == 0
    monkeypatch.setenv(cuda_paged.PREFETCH_ENV, "2")
    assert cuda_paged.attention_prefetch_bytes(1, w) == 2 * 2**20
    monkeypatch.setenv(cuda_paged.PREFETCH_ENV, "0")
    assert cuda_paged.attention_prefetch_bytes(1, w) == 0
