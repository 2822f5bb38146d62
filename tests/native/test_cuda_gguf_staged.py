"""The staged one-token dp4a GEMV (Q4_K/Q5_K weights copied into shared memory by the Hopper bulk copy) gives the
default launch's bits.

The staged kernel hands thread t the slots t, t + 128, ... of every row as the default kernel does, decodes the
same words (copied, not loaded directly) and reduces with the same code, so every (rows, stages) choice must
equal the default launch bit for bit, while the default itself is held to the float64 oracle bound of
test_cuda_gguf (the `gguf` package's dequantizer). Shapes: odd N (a partial last CTA for every R), and K = 4096
(one chunk of 16 super-blocks), 14336 (3.5 chunks: a partial last chunk, the 2-stage ring refilled), 768 (fewer
slots than threads) and 36864 (9 chunks: every stage buffer refilled at least twice, both barrier parities
reused).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_cuda_gguf import assert_dp4a_within, oracle, random_blocks
from test_cuda_gguf_rows import codes_and_default

from candle_vllm.pyengine.ops import cuda_gguf
from candle_vllm.pyengine.ops.cuda import available

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
STAGED_TYPES = [QT.Q4_K, QT.Q5_K]
CHOICES = [(rows, stages) for rows in (0, 2, 4, 8) for stages in (0, 2, 4)]


@pytest.fixture(autouse=True)
def _needs_hopper_kernels() -> None:
    if not available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("the staged GEMV needs sm_90 (bulk copies)")


@pytest.mark.parametrize("k", [4096, 14336, 768, 36864])
@pytest.mark.parametrize("qtype", STAGED_TYPES, ids=lambda t: t.name)
def test_staged_equals_the_default(qtype: QT, k: int) -> None:
    n = 333
    raw = random_blocks(qtype, n, k, seed=11 * int(qtype) + k)
    data = torch.from_numpy(raw).to(DEV)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k - int(qtype))).to(torch.bfloat16)
    want = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, kernel="dp4a")
    assert_dp4a_within(want, x, oracle(raw, qtype, n, k).double())
    for rows, stages in CHOICES:
        got = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, rows=rows, staged=True, stages=stages)
        assert torch.equal(got, want), f"{qtype.name} K={k} rows={rows} stages={stages}: bits differ"


def test_staged_whole_ctas_on_an_8b_shape() -> None:
    """N a multiple of every R (no partial CTA), the q/k/v-sized Q4_K GEMV, the default staged launch."""
    qtype, n, k = QT.Q4_K, 6144, 4096
    data = torch.from_numpy(random_blocks(qtype, n, k, seed=5)).to(DEV)
    x = torch.randn(1, k, device=DEV, dtype=torch.float16, generator=torch.Generator(DEV).manual_seed(5))
    assert torch.equal(cuda_gguf.gemv(x, data, qtype, n, k, staged=True), cuda_gguf.gemv(x, data, qtype, n, k))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_staged_on_quantized_activations(dtype: torch.dtype) -> None:
    """Codes a producer kernel wrote (no quantizer launch): the staged kernel reads them after pdl_wait."""
    qtype, n, k = QT.Q4_K, 517, 14336
    q8, want, data = codes_and_default(qtype, n, k, dtype, seed=8)
    for rows, stages in CHOICES:
        got = cuda_gguf.gemv(q8, data, qtype, n, k, rows=rows, staged=True, stages=stages)
        assert torch.equal(got, want), f"rows={rows} stages={stages}: bits differ"


def test_staged_inside_a_cuda_graph() -> None:
    """Captured once, replayed on new inputs: the staged launch is a plain kernel on the capturing stream."""
    qtype, n, k = QT.Q5_K, 1000, 8192
    data = torch.from_numpy(random_blocks(qtype, n, k, seed=2)).to(DEV)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    cuda_gguf.gemv(x, data, qtype, n, k, staged=True, stages=4)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = cuda_gguf.gemv(x, data, qtype, n, k, staged=True, stages=4)
    for seed in range(3):
        x.copy_(torch.randn(1, k, device=DEV, generator=torch.Generator(DEV).manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, cuda_gguf.gemv(x, data, qtype, n, k))


def test_staged_choices_that_do_not_exist_are_refused() -> None:
    n, k = 64, 512
    q4k = torch.from_numpy(random_blocks(QT.Q4_K, n, k, seed=1)).to(DEV)
    q8 = torch.from_numpy(random_blocks(QT.Q8_0, n, k, seed=1)).to(DEV)
    x = torch.randn(2, k, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one-token choices"):
        cuda_gguf.gemv(x, q4k, QT.Q4_K, n, k, staged=True)
    with pytest.raises(ValueError, match="only Q4_K and Q5_K"):
        cuda_gguf.gemv(x[:1], q8, QT.Q8_0, n, k, staged=True)
    with pytest.raises(ValueError, match="pass staged=true"):
        cuda_gguf.gemv(x[:1], q4k, QT.Q4_K, n, k, stages=2)
    with pytest.raises(ValueError, match="stages must be"):
        cuda_gguf.gemv(x[:1], q4k, QT.Q4_K, n, k, staged=True, stages=3)
    with pytest.raises(ValueError, match="mma kernel takes none"):
        cuda_gguf.gemv(x[:1], q4k, QT.Q4_K, n, k, kernel="mma", staged=True)


def test_gemv_launch_reports_the_staged_shape() -> None:
    """Explicit choices are what launches; the defaults are 2 stages and one of the compiled row counts."""
    for qtype in STAGED_TYPES:
        assert cuda_gguf.gemv_launch(qtype, 1, 4096, 4096, rows=8, staged=True, stages=4) == (8, 4)
        for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (333, 768)):
            rows, stages = cuda_gguf.gemv_launch(qtype, 1, n, k, staged=True)
            assert rows in (2, 4, 8) and stages == 2, (qtype.name, n, k, rows, stages)
        assert cuda_gguf.gemv_launch(qtype, 1, 4096, 4096)[1] == 0
