"""Fixture: a tiny transformers Llama checkpoint for loader tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

CONFIG: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, vocab_size=64,
                              max_position_embeddings=64)


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    """A saved random tiny Llama (config.json + model.safetensors)."""
    torch.manual_seed(0)
    path = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(**CONFIG)).save_pretrained(path)
    return path

