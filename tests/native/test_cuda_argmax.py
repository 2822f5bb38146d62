"""Greedy argmax on device against torch.argmax (ties resolve to the first index)."""

from __future__ import annotations

import pytest
import torch

from candle_vllm.pyengine.ops import cuda

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")


@pytest.fixture(autouse=True)
def _needs_cuda_kernels() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (5, 32001), (64, 128256)])
def test_argmax_matches_torch(dtype: torch.dtype, rows: int, vocab: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab, generator=g, device=DEV) * 5).to(dtype)
    # plant a tie at the top in every row: the lower index must win
    top = logits.float().max(dim=1).values + 1
    a = torch.randint(0, vocab, (rows,), generator=g, device=DEV)
    b = torch.randint(0, vocab, (rows,), generator=g, device=DEV)
    logits[torch.arange(rows, device=DEV), a] = top.to(dtype)
    logits[torch.arange(rows, device=DEV), b] = top.to(dtype)
    got = cuda.argmax(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert torch.equal(got, torch.minimum(a, b))
