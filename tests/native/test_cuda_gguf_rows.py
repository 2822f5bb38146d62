"""The dp4a GGUF GEMV's one-token launch choices (weight rows per CTA, pipelined loop) give the default's bits.

Every choice only changes which CTA owns a row and when each thread issues its weight loads: each output row is
still summed by the same threads over the same blocks in the same order and reduced the same way, so the result
must be bit-identical to the default launch (rows=0, plain loop), which itself is held to the float64 oracle
bound of test_cuda_gguf (the `gguf` package's dequantizer). Shapes: odd N (a partial last CTA for every R > 1),
K = 14336 (3.5 or 7 slots per thread: the pipelined loop's steady state and its last, unpaired slot) and
K = 768 (fewer slots than threads: idle threads, no second slot).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_cuda_gguf import assert_dp4a_within, oracle, random_blocks

from candle_vllm.pyengine.ops import cuda_gguf, native
from candle_vllm.pyengine.ops.cuda import available
from candle_vllm.pyengine.ops.q8_activation import BLOCK, Q8Activation

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
DP4A_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
CHOICES = [(rows, pipelined) for rows in (0, 1, 2, 4, 8) for pipelined in (False, True)]


@pytest.fixture(autouse=True)
def _needs_cuda_kernels() -> None:
    if not available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")


@pytest.mark.parametrize("k", [14336, 768])
@pytest.mark.parametrize("qtype", DP4A_TYPES, ids=lambda t: t.name)
def test_every_launch_choice_equals_the_default(qtype: QT, k: int) -> None:
    n = 333
    raw = random_blocks(qtype, n, k, seed=7 * int(qtype) + k)
    data = torch.from_numpy(raw).to(DEV)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(k + int(qtype))).to(torch.bfloat16)
    want = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, kernel="dp4a")
    assert_dp4a_within(want, x, oracle(raw, qtype, n, k).double())
    for rows, pipelined in CHOICES:
        got = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, kernel="dp4a", rows=rows, pipelined=pipelined)
        assert torch.equal(got, want), f"{qtype.name} K={k} rows={rows} pipelined={pipelined}: bits differ"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_choices_on_quantized_activations(dtype: torch.dtype) -> None:
    """The path that takes codes a producer kernel wrote (no quantizer launch) honours the choices too."""
    qtype, n, k = QT.Q4_K, 517, 4096
    raw = random_blocks(qtype, n, k, seed=3)
    data = torch.from_numpy(raw).to(DEV)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(dtype).to(DEV)
    mod = native.module()
    xq = torch.empty(1, k, dtype=torch.int8, device=DEV)
    xb = torch.empty(1, k // BLOCK * mod.cuda_gguf_xblock_bytes, dtype=torch.uint8, device=DEV)
    want = torch.empty(1, n, dtype=dtype, device=DEV)
    mod.cuda_gguf_gemv_q8(want.data_ptr(), x.data_ptr(), xq.data_ptr(), xb.data_ptr(), data.data_ptr(), 1, n, k,
                          int(qtype), native.dtype_code(x), native.stream(DEV))
    assert_dp4a_within(want, x.cpu(), oracle(raw, qtype, n, k).double())
    q8 = Q8Activation(x, xq, xb)
    for rows, pipelined in CHOICES:
        got = cuda_gguf.gemv(q8, data, qtype, n, k, rows=rows, pipelined=pipelined)
        assert torch.equal(got, want), f"rows={rows} pipelined={pipelined}: bits differ"


def test_unsupported_choices_are_refused() -> None:
    qtype, n, k = QT.Q8_0, 64, 256
    data = torch.from_numpy(random_blocks(qtype, n, k, seed=1)).to(DEV)
    x = torch.randn(2, k, device=DEV, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="one-token choices"):
        cuda_gguf.gemv(x, data, qtype, n, k, rows=4)
    with pytest.raises(ValueError, match="one-token choices"):
        cuda_gguf.gemv(x, data, qtype, n, k, pipelined=True)
    with pytest.raises(ValueError, match="rows must be"):
        cuda_gguf.gemv(x[:1], data, qtype, n, k, rows=3)
    with pytest.raises(ValueError, match="mma kernel takes neither"):
        cuda_gguf.gemv(x[:1], data, qtype, n, k, kernel="mma", rows=2)


def test_gemv_rows_reports_the_launch() -> None:
    """An explicit choice is what launches; the default rule picks one of the compiled choices; several tokens
    keep their fixed tiles (2 rows for two tokens, 4 from three up)."""
    for qtype in DP4A_TYPES:
        assert cuda_gguf.gemv_rows(qtype, 1, 4096, 4096, rows=8) == 8
        assert cuda_gguf.gemv_rows(qtype, 1, 4096, 14336) in (1, 2, 4, 8)
        assert [cuda_gguf.gemv_rows(qtype, m, 4096, 4096) for m in (2, 3, 8)] == [2, 4, 4]
