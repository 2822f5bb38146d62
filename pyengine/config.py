"""Model configuration: one architecture-neutral view of an HF ``config.json`` or of GGUF metadata.

Everything downstream (model construction, KV cache sizing, the API's ``max_model_len``) reads this
dataclass, never the raw files, so the two checkpoint formats behave the same.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# GGUF ``general.architecture`` -> (HF architecture, HF model_type). llama.cpp files Mistral and Yi as llama.
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}


@dataclass
class ModelConfig:
    """The shape and positional-encoding facts a decoder-only model needs."""

    architecture: str  # HF class name, the model registry key (e.g. "LlamaForCausalLM")
    model_type: str  # "llama" | "mistral" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # transformers-style, always with "rope_type"; None = plain RoPE
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # q/k/v projections carry a bias
    o_proj_bias: bool = False  # the output projection does too (Llama/Qwen3 ``attention_bias``; not Qwen2)
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer "full_attention" | "sliding_attention"
    hidden_act: str = "silu"
    rope_freq_factors: list[float] | None = None  # llama.cpp ``rope_freqs`` tensor (Llama 3.1 GGUFs)
    source_format: str = "hf"  # "hf" | "gguf"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # the raw config, for family-specific fields

    def layer_sliding_window(self, layer: int) -> int | None:
        """The attention window of ``layer`` (None = full attention)."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[layer] == "sliding_attention" else None

    def with_yarn_scaling(self, factor: float) -> ModelConfig:
        """YaRN context extension by ``factor`` (``--yarn-scaling-factor``), replacing any rope scaling.

        The pretrained context becomes YaRN's original length and the usable context grows by ``factor``.
        """
        if factor <= 1.0:
            raise ValueError(f"--yarn-scaling-factor must be > 1.0, got {factor}")
        orig = self.max_position_embeddings
        if self.rope_scaling and "original_max_position_embeddings" in self.rope_scaling:
            orig = int(self.rope_scaling["original_max_position_embeddings"])
        scaling = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": orig}
        return dataclasses.replace(self, rope_scaling=scaling, max_position_embeddings=int(orig * factor))


def _normalize_rope(raw: Mapping[str, Any], max_pos: int) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from transformers 5 ``rope_parameters`` or 4.x ``rope_theta``/``rope_scaling``."""
    params = dict(raw.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    legacy = raw.get("rope_scaling")
    if legacy:
        params.update(legacy)
    rope_type = params.pop("rope_type", params.pop("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type in ("yarn", "llama3", "linear") and "factor" not in params:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor' (rope_parameters / rope_scaling in config.json)")
    if rope_type in ("yarn", "llama3"):
        params.setdefault("original_max_position_embeddings", max_pos)
    return theta, {"rope_type": rope_type, **params}


def config_from_hf_dict(raw: Mapping[str, Any]) -> ModelConfig:
    """Read an HF ``config.json`` dict of a Llama-family model."""
    archs = raw.get("architectures") or []
    if not archs:
        raise ValueError("config.json has no 'architectures' entry")
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    max_pos = int(raw.get("max_position_embeddings", 4096))
    theta, scaling = _normalize_rope(raw, max_pos)
    model_type = str(raw.get("model_type", "llama"))
    sliding = raw.get("sliding_window")
    layer_types = raw.get("layer_types")
    num_layers = int(raw["num_hidden_layers"])
    if model_type in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        sliding, layer_types = None, None
    elif sliding is not None and layer_types is None and (model_type in ("qwen2", "qwen3")
                                                          or "max_window_layers" in raw):
        first = int(raw.get("max_window_layers", 28))  # transformers' Qwen2/Qwen3 default
        layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(num_layers)]
    act = str(raw.get("hidden_act", raw.get("hidden_activation", "silu")))  # the model class checks it
    return ModelConfig(
        architecture=str(archs[0]),
        model_type=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # transformers: Qwen2 always biases q/k/v (never o), whatever the config says; Llama and Qwen3 bias all four
        # with attention_bias; Mistral none.
        attention_bias=model_type == "qwen2" or (model_type != "mistral" and bool(raw.get("attention_bias", False))),
        o_proj_bias=model_type not in ("qwen2", "mistral") and bool(raw.get("attention_bias", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=int(sliding) if sliding is not None else None,
        layer_types=list(layer_types) if layer_types is not None else None,
        hidden_act=act,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        extra=dict(raw),
    )


def config_from_hf_dir(path: Path, overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """Read ``path/config.json``, with ``overrides`` (``--hf-overrides``) merged over it."""
    with open(path / "config.json", encoding="utf-8") as f:
        return config_from_hf_dict(merged_config(json.load(f), overrides or {}))


def merged_config(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``raw`` with ``overrides`` laid over it as vLLM's ``hf_overrides`` are: a dict value updates the dict it
    replaces key by key (``{"rope_scaling": {"factor": 4.0}}`` keeps the other rope fields), anything else
    replaces."""
    out = dict(raw)
    for key, value in overrides.items():
        old = out.get(key)
        out[key] = merged_config(old, value) if isinstance(value, Mapping) and isinstance(old, Mapping) else value
    return out


def _scalar(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    value = meta.get(key, default)
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ValueError(f"per-layer values for {key} are not supported (got {value[:4]}...)")
        value = value[0]
    return value


def config_from_gguf_metadata(
    meta: Mapping[str, Any], tensor_shapes: Mapping[str, tuple[int, ...]], freq_factors: list[float] | None = None
) -> ModelConfig:
    """Read GGUF key/values (``{arch}.block_count`` ...) plus the tensor table (torch-order shapes).

    The tensor table answers what the metadata leaves implicit: a missing ``output.weight`` means tied
    embeddings, ``attn_q.bias`` means qkv bias, ``attn_q_norm`` means Qwen3's q/k norm.
    """
    arch = str(meta.get("general.architecture", ""))
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(GGUF_ARCHITECTURES)})"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]

    def key(name: str, default: Any = None) -> Any:
        value = _scalar(meta, f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {arch}.{name}")
        return value

    hidden = int(key("embedding_length"))
    heads = int(key("attention.head_count"))
    max_pos = int(key("context_length", 4096))
    vocab = meta.get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = tensor_shapes["token_embd.weight"][0]
    scaling: dict[str, Any] | None = None
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        scaling = {"rope_type": scaling_type, "factor": float(key("rope.scaling.factor"))}
        if scaling_type == "yarn":
            scaling["original_max_position_embeddings"] = int(key("rope.scaling.original_context_length", max_pos))
    elif scaling_type != "none":
        raise ValueError(f"GGUF rope scaling type {scaling_type!r} is not supported (linear, yarn)")
    head_dim = int(key("attention.key_length", hidden // heads))
    rot_dim = int(key("rope.dimension_count", head_dim))
    if rot_dim != head_dim:
        raise ValueError(f"partial rotary (rope.dimension_count {rot_dim} < head dim {head_dim}) is not supported")
    sliding = meta.get(f"{arch}.attention.sliding_window")
    return ModelConfig(
        architecture=hf_arch,
        model_type=model_type,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")),
        num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        o_proj_bias="blk.0.attn_output.bias" in tensor_shapes,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        sliding_window=int(sliding) if sliding else None,
        rope_freq_factors=freq_factors,
        source_format="gguf",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
    )
