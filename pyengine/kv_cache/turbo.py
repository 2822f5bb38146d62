"""TurboQuant KV cache rows (``--kvcache-dtype turbo8 | turbo4 | turbo3``): each (token, kv head) stores its K and
V vectors as a few bits a value plus an f32 absmax, 2.6-4.3x fewer bytes than a bf16 cache at head_dim 128.

Why these rules: they are the Rust project's layout (shared/reference/NOTES.md): the same codes, scales and
rotation. The caches are not interchangeable byte for byte (the signs come from our own seed, and turbo8 keeps no
second, FP8 copy of V). V is never rotated: 4-bit absmax codes ``q = round(clamp(v / a * 7.5 + 7.5, 0, 15))``, decoded as
``(q - 7.5) / 7.5 * a``. K is e4m3 for turbo8 (saturating at +-448, no scale, as ``--kvcache-dtype fp8``); for
turbo4 / turbo3 it is first rotated, ``H (s * k) / sqrt(D)`` with ``s`` a fixed random sign per channel and ``H``
the Walsh-Hadamard matrix, which spreads a few outlier channels over all of them before absmax quantization (4
bits, or 3 bits as 7 levels ``round(clamp(k / a * 3 + 3, 0, 6))``). The rotation is orthogonal, so attention
rotates each query the same way (:func:`rotate`) and the scores are those of the unrotated vectors; the rotated
keys are never rotated back. Rounding is to nearest even (torch.round, CUDA/C rint).

A row is ``[K codes | K absmax (f32, not turbo8) | V codes | V absmax (f32)]``: at head_dim 128 196 bytes
(turbo8), 136 (turbo4) and 120 (turbo3), against 512 for bf16. Codes pack low bits first: two 4-bit codes a byte
(even channel in the low nibble), eight 3-bit codes in three bytes (channel i at bits 3i..3i+2 of their 24).
A cache is a uint8 tensor ``[1, num_blocks, block_size, num_kv_heads, row_bytes]``: the dense caches' block
geometry in dimensions 1-3, its format told by ``row_bytes`` (:meth:`TurboFormat.of_cache`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from candle_vllm.pyengine.engine_args import EngineConfigError

K_BITS: dict[str, int] = {"turbo8": 8, "turbo4": 4, "turbo3": 3}
SIGN_SEED = 0x7475_7262  # the per-channel signs of the K rotation: fixed, so a cache reads the same in any process
E4M3_MAX = 448.0
_HALF_RANGE = {4: 7.5, 3: 3.0}  # code of zero; codes run 0 .. 2 * half


@dataclass(frozen=True)
class TurboFormat:
    """One TurboQuant mode at one head size: where each part of a row lies."""

    mode: str
    head_dim: int

    def __post_init__(self) -> None:
        if self.mode not in K_BITS:
            raise ValueError(f"unknown TurboQuant mode {self.mode!r}; use one of {', '.join(K_BITS)}")
        d = self.head_dim
        if d < 16 or d % 8:
            raise ValueError(f"--kvcache-dtype {self.mode} needs a head_dim that is a multiple of 8 (>= 16), not {d}")
        if self.rotated and d & (d - 1):
            raise ValueError(f"--kvcache-dtype {self.mode} rotates K with a Walsh-Hadamard transform, which needs a "
                             f"power-of-two head_dim, not {d}; use turbo8 or fp8")

    @property
    def k_bits(self) -> int:
        return K_BITS[self.mode]

    @property
    def rotated(self) -> bool:
        return self.k_bits != 8

    @property
    def k_code_bytes(self) -> int:
        return self.head_dim * self.k_bits // 8

    @property
    def k_bytes(self) -> int:
        return self.k_code_bytes + (4 if self.rotated else 0)

    @property
    def v_bytes(self) -> int:
        return self.head_dim // 2 + 4

    @property
    def row_bytes(self) -> int:
        return self.k_bytes + self.v_bytes

    @classmethod
    def of_cache(cls, kv_cache: torch.Tensor, head_dim: int) -> TurboFormat | None:
        """The format of a TurboQuant cache tensor, None for a dense one (the row sizes of the three modes differ
        for every head_dim >= 16)."""
        if kv_cache.dtype != torch.uint8:
            return None
        if kv_cache.dim() != 5 or kv_cache.shape[0] != 1:
            raise ValueError(f"a TurboQuant cache is uint8 [1, blocks, block_size, kv_heads, row], not "
                             f"{tuple(kv_cache.shape)}")
        for mode in K_BITS:
            fmt = _format(mode, head_dim)
            if fmt is not None and fmt.row_bytes == kv_cache.shape[-1]:
                return fmt
        raise ValueError(f"a uint8 cache row of {kv_cache.shape[-1]} bytes is no TurboQuant row at head_dim {head_dim}")


def turbo_format(mode: str, head_dim: int) -> TurboFormat | None:
    """The format ``--kvcache-dtype mode`` gives heads of ``head_dim`` (None for auto / fp8); a one-line
    ``EngineConfigError`` where those heads cannot take it."""
    if mode not in K_BITS:
        return None
    try:
        return TurboFormat(mode, head_dim)
    except ValueError as e:
        raise EngineConfigError(str(e)) from None


@functools.cache
def _format(mode: str, head_dim: int) -> TurboFormat | None:
    try:
        return TurboFormat(mode, head_dim)
    except ValueError:
        return None


@functools.cache
def _signs(head_dim: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(SIGN_SEED)
    bits = torch.randint(0, 2, (head_dim,), generator=g)
    return (1.0 - 2.0 * bits.float()).to(device)


def channel_signs(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """The K rotation's +-1 per channel (f32, on ``device``, default the CPU): the native kernels take them from
    here (made once per device, so the first use must not be inside CUDA-graph capture)."""
    return _signs(head_dim, device or torch.device("cpu"))


def _hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalised Walsh-Hadamard transform (Sylvester order) over the last dimension, a power of two."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x


def rotate(x: torch.Tensor) -> torch.Tensor:
    """``H (s * x) / sqrt(D)`` over the last dimension, in f32: the keys' rotation, applied to queries too."""
    d = x.shape[-1]
    return _hadamard(x.float() * _signs(d, x.device)) / math.sqrt(d)


def _absmax_codes(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] f32 -> codes [..., D] uint8 and absmax [..., 1] f32 (an all-zero vector codes to its zero)."""
    half = _HALF_RANGE[bits]
    a = x.abs().amax(-1, keepdim=True)
    safe = torch.where(a > 0, a, torch.ones_like(a))
    q = torch.round((x / safe * half + half).clamp(0, 2 * half))
    return q.to(torch.uint8), a


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 4:
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    eights = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int32)
    word = eights[..., 0]
    for i in range(1, 8):
        word = word | (eights[..., i] << (3 * i))
    three = torch.stack([(word >> s) & 0xFF for s in (0, 8, 16)], dim=-1)
    return three.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def _unpack(packed: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    if bits == 4:
        return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], d)
    three = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = three[..., 0] | (three[..., 1] << 8) | (three[..., 2] << 16)
    codes = torch.stack([(word >> (3 * i)) & 7 for i in range(8)], dim=-1)
    return codes.reshape(*packed.shape[:-1], d).to(torch.uint8)


def _f32_bytes(a: torch.Tensor) -> torch.Tensor:
    return a.contiguous().view(torch.uint8)


def _bytes_f32(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float32)


def encode(k: torch.Tensor, v: torch.Tensor, fmt: TurboFormat) -> torch.Tensor:
    """k, v [..., D] -> rows [..., row_bytes] uint8."""
    v_codes, v_max = _absmax_codes(v.float(), 4)
    if fmt.rotated:
        k_codes, k_max = _absmax_codes(rotate(k), fmt.k_bits)
        k_part = torch.cat([_pack(k_codes, fmt.k_bits), _f32_bytes(k_max)], dim=-1)
    else:
        k_part = k.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return torch.cat([k_part, _pack(v_codes, 4), _f32_bytes(v_max)], dim=-1)


def _dequant(codes: torch.Tensor, absmax: torch.Tensor, bits: int) -> torch.Tensor:
    half = _HALF_RANGE[bits]
    return (codes.float() - half) * (absmax / half)


def decode(rows: torch.Tensor, fmt: TurboFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """rows [..., row_bytes] -> K (rotated for turbo4 / turbo3) and V [..., D], f32."""
    d, kc = fmt.head_dim, fmt.k_code_bytes
    if fmt.rotated:
        k = _dequant(_unpack(rows[..., :kc], fmt.k_bits, d), _bytes_f32(rows[..., kc : kc + 4]), fmt.k_bits)
    else:
        k = rows[..., :kc].contiguous().view(torch.float8_e4m3fn).float()
    vo = fmt.k_bytes
    v = _dequant(_unpack(rows[..., vo : vo + d // 2], 4, d), _bytes_f32(rows[..., vo + d // 2 :]), 4)
    return k, v


def write(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
          fmt: TurboFormat) -> None:
    """Store k, v [T, Hk, D] at flat slots [T] of a TurboQuant cache."""
    flat = kv_cache.view(-1, kv_cache.shape[3], fmt.row_bytes)
    flat.index_copy_(0, slot_mapping, encode(k, v, fmt))


def read_blocks(kv_cache: torch.Tensor, index: torch.Tensor, fmt: TurboFormat) -> torch.Tensor:
    """``[2, *index.shape, block_size, Hk, D]`` f32 K (rotated for turbo4 / turbo3) and V of the indexed blocks."""
    k, v = decode(kv_cache[0, index], fmt)
    return torch.stack((k, v))
