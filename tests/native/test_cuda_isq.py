"""ISQ on the GPU: blocks byte-equal to the CPU quantizer (itself byte-equal to llama.cpp's, see
tests/pyengine/quant/test_isq.py) for every type and input dtype, on the caller's device."""

from __future__ import annotations

import pytest
import torch

from candle_vllm.pyengine.quant.isq import ISQ_QTYPES, quantize

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")



def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Magnitudes over ~4 decades, 30x outliers, sign-constant rows and a constant row."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 1.5) * 0.05
    w[::5, ::37] *= 30
    w[1], w[2], w[3] = -w[1].abs(), w[2].abs(), 0.37
    w[4] *= 1e-3
    return w


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", list(ISQ_QTYPES))
def test_cuda_blocks_equal_cpu_blocks(name: str, dtype: torch.dtype) -> None:
    w = _weights(257, 2048, seed=len(name)).to(dtype)  # 257 rows: a partial last CTA
    got = quantize(w.to(DEV), name)
    assert got.device.type == "cuda"
    want = quantize(w, name)
    bad = (got.cpu() != want).reshape(-1, got.shape[1]).any(1)
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} rows differ from the CPU quantizer"


def test_cuda_quantize_runs_on_the_tensors_device_and_stream() -> None:
    w = _weights(64, 4096, seed=9).to(torch.bfloat16)
    stream = torch.cuda.Stream(DEV)
    with torch.cuda.stream(stream):
        got = quantize(w.to(DEV, non_blocking=False), "q4k")
    stream.synchronize()
    assert torch.equal(got.cpu(), quantize(w, "q4k"))
