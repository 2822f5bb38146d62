"""Rotary position embeddings: frequency tables (plain, linear, llama3, YaRN, GGUF freq factors) and their
application in the two layouts checkpoints use.

HF checkpoints rotate the two halves of each head ("neox" layout); the original Llama/GPT-J code and
llama.cpp's NORM mode rotate adjacent pairs ("gptj" layout). The formulas follow transformers'
``modeling_rope_utils`` so logits match it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda_rotary, cuda_turbo
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.row_pairs import deinterleave_halves

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The fused RoPE + cache-write launch saves a launch where launches dominate (decode: H200, Llama-3-8B heads,
# 64 tokens 2.3 vs 3.8 us for the two launches) but is slower on long prefills (4096 tokens 35.0 vs 32.8 us).
FUSED_CACHE_MAX_TOKENS = 256


def _yarn_inv_freq(
    base_inv: torch.Tensor, dim: int, base: float, params: dict[str, Any]
) -> tuple[torch.Tensor, float]:
    factor = float(params["factor"])
    orig = float(params["original_max_position_embeddings"])
    attention_factor = params.get("attention_factor")
    if attention_factor is None:

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv = base_inv / factor * (1 - extrapolation_weight) + base_inv * extrapolation_weight
    return inv, float(attention_factor)


def _llama3_inv_freq(base_inv: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_ff, high_ff = float(params["low_freq_factor"]), float(params["high_freq_factor"])
    old_len = float(params["original_max_position_embeddings"])
    wavelen = 2 * math.pi / base_inv
    scaled = torch.where(wavelen > old_len / low_ff, base_inv / factor, base_inv)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
    return torch.where(medium, smoothed, scaled)


def rope_inv_freq(
    rotary_dim: int,
    rope_theta: float,
    rope_scaling: dict[str, Any] | None = None,
    freq_factors: Sequence[float] | None = None,
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim/2] (f32) and the factor cos/sin are multiplied by (YaRN's mscale).

    ``rope_scaling`` is a transformers-style dict with ``rope_type`` (or legacy ``type``); ``freq_factors``
    are llama.cpp's ``rope_freqs`` tensor (Llama 3.1 GGUFs carry their llama3 scaling that way).
    """
    base_inv = 1.0 / (rope_theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    if freq_factors is not None:
        base_inv = base_inv / torch.tensor(list(freq_factors), dtype=torch.float32)
    params = rope_scaling or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return base_inv, 1.0
    if rope_type == "linear":
        return base_inv / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(base_inv, params), 1.0
    if rope_type == "yarn":
        return _yarn_inv_freq(base_inv, rotary_dim, rope_theta, params)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)}); "
        "remove rope_scaling from config.json or use --yarn-scaling-factor"
    )


def rope_cos_sin_cache(
    inv_freq: torch.Tensor, attention_factor: float, max_positions: int, device: torch.device | None = None
) -> torch.Tensor:
    """[max_positions, rotary_dim] f32 table: cos in the first half of each row, sin in the second."""
    pos = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = torch.outer(pos, inv_freq.to(device))
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    if is_neox:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


class RopeCacheTarget(NamedTuple):
    """Where a decode step's RoPE and K/V store go, for a projection that does both in its own kernel
    (``Linear.forward_rope_cache``): the cos/sin table, the positions, the layer's paged cache and its slots."""

    kv_heads: int
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    kv_cache: torch.Tensor
    slot_mapping: torch.Tensor


def apply_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
    pair_group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [T, Hq, D] and k [T, Hk, D] by their token positions [T]; returns new tensors.

    Only the first ``rotary_dim`` (the cache's width) channels of each head rotate (partial rotary).
    cos/sin are cast to the activations' dtype before use, as transformers does. On CUDA the native kernel
    rotates q and k in place (they are usually views into the fused qkv output) and returns them.
    ``pair_group`` (neox only; 0: the standard layout): the heads come with their halves interleaved in groups of
    that many channels (a q/k/v weight stored for a decode GEMM's RoPE epilogue, ``ops.row_pairs``: 8 dense, 1
    GGUF); the result is in the standard layout either way.
    """
    if pair_group and not is_neox:
        raise ValueError("apply_rotary: interleaved halves (pair_group) are a neox layout; gptj heads have none")
    if q.device.type == "cuda" and cuda_rotary.rotary_supported(q, k, positions, cos_sin_cache, pair_group):
        cuda_rotary.rotary_embedding_(q, k, positions, cos_sin_cache, is_neox, pair_group)
        return q, k
    if pair_group:
        q = deinterleave_halves(q, q.shape[-1], pair_group)
        k = deinterleave_halves(k, k.shape[-1], pair_group)
    rotary_dim = cos_sin_cache.shape[-1]
    cos, sin = cos_sin_cache[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    out = []
    for x in (q, k):
        if rotary_dim == x.shape[-1]:
            out.append(_rotate(x, cos, sin, is_neox))
        else:
            rot = _rotate(x[..., :rotary_dim], cos, sin, is_neox)
            out.append(torch.cat([rot, x[..., rotary_dim:]], dim=-1))
    return out[0], out[1]


def apply_rotary_and_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pair_group: int = 0,
    norm: DeferredRMSNorm | None = None,
) -> bool:
    """Rotate q and k in place and store the rotated k and v into the paged ``kv_cache`` at ``slot_mapping`` in
    one CUDA launch, saving the attention's separate cache write (the caller then tells it the cache is written).
    A TurboQuant cache takes its rows from ``cuda_turbo.rope_cache_write_``, which leaves k and v as they decode.
    Returns False, having done nothing, where that kernel does not apply (CPU, partial rotary, unaligned views,
    more than ``FUSED_CACHE_MAX_TOKENS`` tokens); the caller then runs :func:`apply_rotary` and the attention's
    own cache write. ``pair_group`` as in :func:`apply_rotary`. ``norm``: q, k and v are first scaled per token by
    it, v in place too (:class:`DeferredRMSNorm`); on False nothing is scaled either."""
    if q.shape[0] > FUSED_CACHE_MAX_TOKENS or q.device.type != "cuda":
        return False
    fmt = TurboFormat.of_cache(kv_cache, q.shape[-1])
    if fmt is not None:
        if not cuda_turbo.rope_cache_write_supported(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, fmt,
                                                     pair_group, norm):
            return False
        cuda_turbo.rope_cache_write_(q, k, v, positions, cos_sin_cache, is_neox, kv_cache, slot_mapping, fmt,
                                     pair_group, norm)
        return True
    if not cuda_rotary.rotary_cache_supported(q, k, v, positions, cos_sin_cache, kv_cache, slot_mapping, pair_group,
                                              norm):
        return False
    cuda_rotary.rotary_embedding_cache_(
        q, k, v, positions, cos_sin_cache, is_neox, kv_cache, slot_mapping, pair_group, norm
    )
    return True
