"""Set-up of the native-kernel tests: a ``cuda``-marked test on a build without the CUDA kernels fails instead of
passing on the torch references (``tests/conftest.py`` already skips them where no GPU is visible)."""

from __future__ import annotations

import pytest
import torch

from candle_vllm.pyengine.ops import cuda


@pytest.fixture(autouse=True)
def _needs_cuda_kernels(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("cuda") is not None and not cuda.available(torch.device("cuda")):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
