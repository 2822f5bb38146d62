"""Greedy argmax on device against torch.argmax (ties resolve to the first index)."""

from __future__ import annotations

import pytest
import torch

from candle_vllm.pyengine.ops import cuda

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")



@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,vocab", [(1, 7), (1, 128256), (3, 4099), (5, 32001), (64, 128256), (300, 5000)])
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_special_values_match_torch(dtype: torch.dtype) -> None:
    """Rows split over many CTAs: NaN beats everything (first NaN wins), -0.0 ties +0.0 (lower index wins), an
    all -inf row picks index 0 — each winner placed in a different CTA's slice than the runner-up."""
    vocab = 128256
    g = torch.Generator(device=DEV).manual_seed(7)
    logits = (-1 - torch.rand(4, vocab, generator=g, device=DEV)).to(dtype)
    logits[0, 90000] = float("nan")
    logits[0, 120000] = float("nan")
    logits[0, 5] = float("inf")
    logits[1, 100000] = -0.0
    logits[1, 110000] = 0.0
    logits[2] = float("-inf")
    logits[3, 70000] = 3.0
    logits[3, 127999] = 3.0
    got = cuda.argmax(logits)
    assert torch.equal(got, torch.argmax(logits, dim=-1))
    assert got.tolist() == [90000, 100000, 0, 70000]
