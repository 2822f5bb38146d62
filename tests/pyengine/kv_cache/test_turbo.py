"""TurboQuant cache rows (``kv_cache/turbo.py``) against an independent numpy encoder written from the layout in
shared/reference/NOTES.md: a float64 Hadamard matrix, per-element rounding, bit packing by loops."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from candle_vllm.pyengine.engine_args import EngineConfigError
from candle_vllm.pyengine.kv_cache import kv_bytes_per_token, turbo
from candle_vllm.pyengine.kv_cache.cache_tensors import allocate_kv_caches
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat, turbo_format


def hadamard(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h


def oracle_rotate(x: np.ndarray) -> np.ndarray:
    """H (s * x) / sqrt(D) in float64 by a matrix product."""
    d = x.shape[-1]
    return (x * turbo.channel_signs(d).double().numpy()) @ hadamard(d).T / math.sqrt(d)


def oracle_codes(x: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Absmax codes of each row of x (float64): codes, absmax, and each code's pre-rounding value."""
    half = (levels - 1) / 2
    a = np.abs(x).max(-1, keepdims=True)
    pre = np.clip(x / np.where(a > 0, a, 1) * half + half, 0, levels - 1)
    return np.rint(pre).astype(np.int64), a, pre


def oracle_unpack(packed: np.ndarray, bits: int, d: int) -> np.ndarray:
    out = np.zeros((*packed.shape[:-1], d), dtype=np.int64)
    for idx in np.ndindex(packed.shape[:-1]):
        row = packed[idx]
        for c in range(d):
            bit = c * bits
            word = int(row[bit // 8]) | (int(row[bit // 8 + 1]) << 8 if bit // 8 + 1 < len(row) else 0)
            out[(*idx, c)] = (word >> (bit % 8)) & ((1 << bits) - 1)
    return out


def f32_of(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float32)


def keys_with_outliers(n: int, hk: int, d: int, g: torch.Generator) -> torch.Tensor:
    """Random keys with three outlier channels, as real models' keys have: what the rotation is for."""
    k = torch.randn(n, hk, d, generator=g)
    k[..., [3, 17, d - 5]] *= 12
    return k


@pytest.mark.parametrize(("d", "sizes"), [(128, {"turbo8": 196, "turbo4": 136, "turbo3": 120}),
                                          (64, {"turbo8": 100, "turbo4": 72, "turbo3": 64})])
def test_row_sizes_are_the_rust_projects(d: int, sizes: dict[str, int]) -> None:
    """NOTES.md: 136 bytes (turbo4) and 120 (turbo3) per token-head at head_dim 128; turbo8 is 128 e4m3 bytes of K
    plus the 68-byte V (the Rust project also allocates a full FP8 V there, which we do not)."""
    for mode, size in sizes.items():
        fmt = TurboFormat(mode, d)
        assert fmt.row_bytes == size
        cache = allocate_kv_caches(2, 3, 16, 4, d, torch.bfloat16, torch.device("cpu"), fmt)[0]
        assert cache.shape == (1, 3, 16, 4, size) and cache.dtype == torch.uint8
        assert TurboFormat.of_cache(cache, d) == fmt
        assert kv_bytes_per_token(32, 8, d, torch.bfloat16, fmt) == 32 * 8 * size


def test_head_sizes_the_modes_refuse() -> None:
    with pytest.raises(EngineConfigError, match="power-of-two head_dim, not 80; use turbo8 or fp8"):
        turbo_format("turbo4", 80)
    with pytest.raises(EngineConfigError, match="multiple of 8"):
        turbo_format("turbo8", 20)
    assert turbo_format("turbo8", 80) == TurboFormat("turbo8", 80)
    assert turbo_format("fp8", 128) is None and turbo_format("auto", 128) is None
    with pytest.raises(ValueError, match="no TurboQuant row"):
        TurboFormat.of_cache(torch.zeros(1, 2, 4, 2, 99, dtype=torch.uint8), 128)


@pytest.mark.parametrize("mode", ["turbo4", "turbo3"])
@pytest.mark.parametrize("d", [64, 128])
def test_rotated_keys_match_the_independent_encoder(mode: str, d: int) -> None:
    """Bytes of K: the codes of the float64-rotated keys (a code may differ only where the value sits on a
    rounding tie within f32 noise), packed low bits first, then the absmax as f32; zero vectors code to zero."""
    g = torch.Generator().manual_seed(11)
    k = keys_with_outliers(7, 3, d, g)
    k[2, 1] = 0
    fmt = TurboFormat(mode, d)
    rows = turbo.encode(k, torch.randn(7, 3, d, generator=g), fmt).numpy()
    levels = 16 if mode == "turbo4" else 7
    codes, absmax, pre = oracle_codes(oracle_rotate(k.double().numpy()), levels)
    got = oracle_unpack(rows[..., : fmt.k_code_bytes], fmt.k_bits, d)
    off = got != codes
    assert np.all(np.abs(got - codes)[off] == 1) and np.all(np.abs(pre[off] % 1 - 0.5) < 1e-4), pre[off]
    assert off.mean() < 0.01
    np.testing.assert_allclose(f32_of(rows[..., fmt.k_code_bytes : fmt.k_bytes])[..., 0], absmax[..., 0], rtol=1e-6)
    assert absmax[2, 1, 0] == 0 and np.all(got[2, 1] == (levels - 1) // 2 + (levels % 2 == 0))


@pytest.mark.parametrize("mode", ["turbo8", "turbo4", "turbo3"])
def test_values_and_turbo8_keys_match_the_independent_encoder(mode: str) -> None:
    """V: 4-bit absmax codes of the unrotated values, exactly; turbo8's K: torch's e4m3 cast of the clamped keys."""
    g = torch.Generator().manual_seed(12)
    d = 128
    k, v = torch.randn(5, 2, d, generator=g) * 200, torch.randn(5, 2, d, generator=g)
    fmt = TurboFormat(mode, d)
    rows = turbo.encode(k, v, fmt).numpy()
    codes, absmax, _ = oracle_codes(v.numpy().astype(np.float32), 16)
    vo = fmt.k_bytes
    assert np.array_equal(oracle_unpack(rows[..., vo : vo + d // 2], 4, d), codes)
    np.testing.assert_array_equal(f32_of(rows[..., vo + d // 2 :])[..., 0], absmax[..., 0])
    if mode == "turbo8":
        want = k.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        assert np.array_equal(rows[..., :d], want)


@pytest.mark.parametrize("mode", ["turbo8", "turbo4", "turbo3"])
def test_decode_is_within_half_a_step(mode: str) -> None:
    """decode(encode(x)): each value within half a code step of x (rotated keys against the float64 rotation)."""
    g = torch.Generator().manual_seed(13)
    d = 128
    k, v = keys_with_outliers(9, 2, d, g), torch.randn(9, 2, d, generator=g)
    fmt = TurboFormat(mode, d)
    got_k, got_v = turbo.decode(turbo.encode(k, v, fmt), fmt)
    step_v = v.abs().amax(-1, keepdim=True) / 7.5
    assert torch.all((got_v - v).abs() <= step_v / 2 + 1e-6)
    if fmt.rotated:
        want = torch.from_numpy(oracle_rotate(k.double().numpy())).float()
        step = want.abs().amax(-1, keepdim=True) / (7.5 if mode == "turbo4" else 3.0)
        assert torch.all((got_k - want).abs() <= step / 2 + 1e-5)
    else:
        assert torch.equal(got_k, k.to(torch.float8_e4m3fn).float())
