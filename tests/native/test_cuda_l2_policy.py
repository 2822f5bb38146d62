"""The L2 policy of the read-once streams (native/cuda/l2_policy.cuh): the kernels whose K/V or weight loads take
evict-first give the same bits with every stream's policy on or off (``CANDLE_VLLM_L2_EVICT_FIRST``, read at each
launch)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from test_cuda_attention import _paged_case

from candle_vllm.pyengine.ops import cuda, cuda_paged, cuda_wide

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
POLICY_ENV = "CANDLE_VLLM_L2_EVICT_FIRST"


@pytest.fixture(autouse=True)
def _needs_cuda_kernels() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")


def _same_under_every_policy(run: Callable[[], torch.Tensor], monkeypatch: pytest.MonkeyPatch) -> None:
    results = []
    for bits in ("0", "7"):
        monkeypatch.setenv(POLICY_ENV, bits)
        results.append(run())
    monkeypatch.delenv(POLICY_ENV)
    results.append(run())
    assert all(torch.equal(results[0], r) for r in results[1:])


@pytest.mark.parametrize(
    "seq_lens,max_seq_len,partition_size",
    # one piece; pieces reduced by the last CTA; pieces past short contexts, reduced by the second kernel
    [([300, 17, 1024], 1024, None), ([700, 1500, 33], 2048, 256), ([40, 9], 4096, 128)],
)
def test_paged_decode(
    seq_lens: list[int], max_seq_len: int, partition_size: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, cache, table_t, _ = _paged_case(seq_lens, 32, 8, 128, 16, torch.bfloat16, seed=len(seq_lens))
    lens_t = torch.tensor(seq_lens, dtype=torch.int32, device=DEV)
    _same_under_every_policy(
        lambda: cuda_paged.paged_decode_attention(
            q, cache, table_t, lens_t, 0.088, max_seq_len, partition_size=partition_size
        ),
        monkeypatch,
    )


@pytest.mark.parametrize("m", [1, 5, 16])
def test_skinny_gemm(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 4096, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(1000, 4096, generator=g, device=DEV).to(torch.bfloat16)
    _same_under_every_policy(lambda: cuda.skinny_gemm(x, w), monkeypatch)


@pytest.mark.parametrize("m", [17, 64])
def test_wide_gemm(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator(device=DEV).manual_seed(m)
    x = torch.randn(m, 4096, generator=g, device=DEV).to(torch.bfloat16)
    w = torch.randn(2048 + 128, 4096, generator=g, device=DEV).to(torch.bfloat16)
    if not cuda_wide.wide_gemm_supported(x, w):
        pytest.skip("the wide GEMM needs a Hopper GPU and an sm_90a build")
    _same_under_every_policy(lambda: cuda_wide.wide_gemm(x, w), monkeypatch)
