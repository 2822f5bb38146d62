"""Which weights the Hopper wide GEMM takes (cuda_wide.fills_waves): several 256-row waves over the SMs, filled to
90 % on average; a pure rule, checked here without a GPU on the shapes it was measured for (132 SMs, an H200)."""

from __future__ import annotations

import pytest

from candle_vllm.pyengine.ops.cuda_wide import fills_waves


@pytest.mark.parametrize(
    "n,sms,taken",
    [
        (128256, 132, True),  # Llama-3 LM head: 501 tiles, 3.8 waves of 4 filled to 95 %
        (151936, 132, True),  # Qwen3 LM head: 594 tiles of 660 slots, 90 %
        (28672, 132, False),  # Llama-3-8B gate/up: 112 tiles, one partial wave
        (57344, 132, False),  # 224 tiles: the second wave is 70 % full (85 % on average)
        (256 * 132, 132, False),  # exactly one wave
        (256 * 264, 132, True),  # exactly two
        (49152, 132, False),  # SmolLM2 LM head: 192 tiles, 73 %
        (128256, 78, True),  # a smaller GPU: 501 tiles of 546 slots
    ],
)
def test_fills_waves(n: int, sms: int, taken: bool) -> None:
    assert fills_waves(n, sms) is taken
