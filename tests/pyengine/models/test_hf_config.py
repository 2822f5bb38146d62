"""Reading an HF ``config.json`` the way transformers reads it, for the switches whose defaults differ by family:
checked against the transformers model built from the same dict (its modules are the oracle)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

from candle_vllm.pyengine.config import config_from_hf_dict
from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.loader.errors import ModelLoadError

SMALL: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                             num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)


def _hf_biases(cls: type, raw: dict[str, Any]) -> tuple[bool, bool]:
    """(q/k/v biased, o_proj biased) in the transformers model of ``raw``."""
    attn = AutoModelForCausalLM.from_config(cls(**raw)).model.layers[0].self_attn
    return attn.q_proj.bias is not None, attn.o_proj.bias is not None


@pytest.mark.parametrize(("cls", "extra"), [
    (Qwen2Config, {"attention_bias": False}),  # transformers' Qwen2 biases q/k/v whatever the key says
    (Qwen2Config, {}),
    (Qwen3Config, {"attention_bias": True}),  # all four
    (Qwen3Config, {}),
])
def test_attention_biases_follow_transformers(cls: type, extra: dict[str, Any]) -> None:
    raw = {**SMALL, **extra, "architectures": [cls.__name__.replace("Config", "ForCausalLM")]}
    hf_raw = {**cls(**raw).to_dict(), **extra}
    ours = config_from_hf_dict(hf_raw)
    assert (ours.attention_bias, ours.o_proj_bias) == _hf_biases(cls, raw)


@pytest.mark.parametrize("cls", [Qwen2Config, Qwen3Config])
def test_sliding_window_without_max_window_layers_uses_the_transformers_default(cls: type) -> None:
    """``use_sliding_window`` with neither ``layer_types`` nor ``max_window_layers`` in the file: transformers
    defaults the latter to 28, so these 3 layers all attend fully."""
    hf = cls(**SMALL, use_sliding_window=True, sliding_window=6,
             architectures=[cls.__name__.replace("Config", "ForCausalLM")])
    raw = {k: v for k, v in hf.to_dict().items() if k not in ("layer_types", "max_window_layers")}
    ours = config_from_hf_dict(raw)
    assert [ours.layer_sliding_window(i) for i in range(3)] == [None, None, None]
    assert hf.layer_types == ["full_attention"] * 3


def test_an_unported_architecture_is_named_before_its_activation(tmp_path: Path) -> None:
    """Gemma-style configs (another activation too) must be refused for their architecture, the real reason."""
    raw = {**SMALL, "architectures": ["GemmaForCausalLM"], "model_type": "gemma", "hidden_act": "gelu_pytorch_tanh"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="architecture 'GemmaForCausalLM' is not supported"):
        load_model(resolve_model_source(str(tmp_path), load_format="dummy"), torch.float32, torch.device("cpu"),
                   load_format="dummy")
    raw["architectures"] = ["LlamaForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="hidden_act 'gelu_pytorch_tanh' is not supported"):
        load_model(resolve_model_source(str(tmp_path), load_format="dummy"), torch.float32, torch.device("cpu"),
                   load_format="dummy")


@pytest.mark.parametrize("rope_type", ["yarn", "llama3", "linear"])
def test_rope_scaling_without_a_factor_is_a_clear_error(rope_type: str) -> None:
    raw = {**SMALL, "architectures": ["LlamaForCausalLM"], "rope_parameters": {"rope_type": rope_type}}
    with pytest.raises(ValueError, match=f"rope scaling '{rope_type}' needs a 'factor'"):
        config_from_hf_dict(raw)
