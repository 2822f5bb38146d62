"""RoPE tables against transformers' rope init functions, and both rotation layouts against independent
formulas (transformers' rotate_half for neox; Meta's complex-number form for adjacent pairs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from candle_vllm.pyengine.ops.rotary import apply_rotary, rope_cos_sin_cache, rope_inv_freq

SCALINGS: list[dict[str, Any]] = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128, "beta_fast": 16,
     "mscale": 0.9, "mscale_all_dim": 1.1},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: s["rope_type"])
def test_inv_freq_matches_transformers(scaling: dict[str, Any]) -> None:
    cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=512,
                      rope_parameters={"rope_theta": 50000.0, **scaling})
    want_inv, want_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, "cpu")
    got_inv, got_factor = rope_inv_freq(64, 50000.0, scaling)
    torch.testing.assert_close(got_inv, want_inv.float(), atol=0, rtol=1e-6)
    assert got_factor == pytest.approx(want_factor, rel=1e-6)


def test_unknown_rope_type_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'longrope' is not supported"):
        rope_inv_freq(64, 10000.0, {"rope_type": "longrope"})


def test_neox_matches_transformers_rotate_half() -> None:
    g = torch.Generator().manual_seed(3)
    inv, factor = rope_inv_freq(32, 10000.0, {"rope_type": "yarn", "factor": 2.0,
                                              "original_max_position_embeddings": 16})
    cache = rope_cos_sin_cache(inv, factor, 64)
    q, k = torch.randn(9, 4, 32, generator=g), torch.randn(9, 2, 32, generator=g)
    pos = torch.randint(0, 64, (9,), generator=g)
    freqs = torch.outer(pos.float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    want_q, want_k = apply_rotary_pos_emb(q, k, emb.cos() * factor, emb.sin() * factor, unsqueeze_dim=1)
    got_q, got_k = apply_rotary(q, k, pos, cache, is_neox=True)
    torch.testing.assert_close(got_q, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)


def test_gptj_matches_complex_rotation_of_adjacent_pairs() -> None:
    g = torch.Generator().manual_seed(4)
    inv, _ = rope_inv_freq(16, 10000.0)
    cache = rope_cos_sin_cache(inv, 1.0, 32)
    q, k = torch.randn(5, 3, 16, generator=g), torch.randn(5, 1, 16, generator=g)
    pos = torch.tensor([0, 3, 7, 20, 31])
    rot = torch.polar(torch.ones(5, 8), torch.outer(pos.float(), inv)).unsqueeze(1)

    def meta_llama(x: torch.Tensor) -> torch.Tensor:
        return torch.view_as_real(torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2)) * rot).flatten(-2)

    got_q, got_k = apply_rotary(q, k, pos, cache, is_neox=False)
    torch.testing.assert_close(got_q, meta_llama(q), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_k, meta_llama(k), atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_tail_alone() -> None:
    g = torch.Generator().manual_seed(5)
    inv, _ = rope_inv_freq(8, 10000.0)
    cache = rope_cos_sin_cache(inv, 1.0, 16)
    q, k = torch.randn(4, 2, 16, generator=g), torch.randn(4, 2, 16, generator=g)
    pos = torch.tensor([1, 2, 5, 9])
    got_q, _ = apply_rotary(q, k, pos, cache)
    full_q, _ = apply_rotary(q[..., :8], k[..., :8], pos, cache)
    torch.testing.assert_close(got_q[..., :8], full_q)
    torch.testing.assert_close(got_q[..., 8:], q[..., 8:])
