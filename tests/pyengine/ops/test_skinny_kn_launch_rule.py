"""The [K, N] decode GEMM's launch rule (cuda_kn.skinny_gemm_kn_launch): a pure function of the shape, the SM count
and the CTAs an SM holds, checked here without a GPU on the Llama-3-8B shapes (132 SMs, an H200) and odd ones."""

from __future__ import annotations

import math

import pytest

from candle_vllm.pyengine.ops.cuda_kn import SLAB, STRIP, skinny_gemm_kn_launch

SHAPES = [(28672, 4096), (4096, 14336), (6144, 4096), (4096, 4096), (64, 16), (192, 1040), (57344, 8192)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("per_sm", [1, 3, 4, 8])
def test_one_wave_and_no_empty_split(n: int, k: int, per_sm: int) -> None:
    sms, asked = 132, []

    def resident(warps: int, stage: int) -> int:
        asked.append((warps, stage))
        return per_sm

    splits, warps, stage = skinny_gemm_kn_launch(n, k, sms, resident)
    strips, slabs = n // STRIP, k // SLAB
    assert (warps, stage) in asked, "the occupancy asked for must be that of the launch chosen"
    assert warps in (4, 8) and stage in (1, 2, 4)
    assert 1 <= splits <= 16
    assert splits == 1 or splits * strips <= per_sm * sms, "a split-K grid must fit one wave"
    per_split = math.ceil(slabs / splits)
    assert (splits - 1) * per_split < slabs, "every split must own at least one slab"
    assert splits == 1 or per_split >= warps * stage, "every warp of a split must own a stage"


def test_wide_weights_take_one_split_of_four_warps() -> None:
    """gate/up (448 strips >= two CTAs per SM): this kernel's best in session 33's sweep at 1, 4 and 16 tokens, one
    split, 4 warps, 2 slabs a stage."""
    assert skinny_gemm_kn_launch(28672, 4096, 132, lambda w, s: 4) == (1, 4, 2)


def test_narrow_weights_split_k_to_fill_the_sms() -> None:
    """down 4096x14336 (64 strips): 8 warps, one slab a stage, 8 splits where 4 CTAs fit per SM (the probe's best)."""
    assert skinny_gemm_kn_launch(4096, 14336, 132, lambda w, s: 4) == (8, 8, 1)
