"""``load_model``: config + model + weights + tokenizer + generation config from a ``ModelSource``."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from candle_vllm.pyengine.config import ModelConfig, config_from_hf_dir, merged_config
from candle_vllm.pyengine.loader import dummy, gguf_io, safetensors_io
from candle_vllm.pyengine.loader.errors import ModelLoadError
from candle_vllm.pyengine.loader.pooling import Matryoshka, declared_pooling
from candle_vllm.pyengine.loader.source import LOAD_FORMATS, ModelSource
from candle_vllm.pyengine.models.base import CausalLM
from candle_vllm.pyengine.models.registry import model_class
from candle_vllm.pyengine.quant import WeightData
from candle_vllm.pyengine.quant.isq import is_target, isq_weight, resolve_qtype

if TYPE_CHECKING:
    from candle_vllm.pyengine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# The config keys --hf-overrides may set for a GGUF model: declarations its metadata has no key for.
GGUF_OVERRIDES = frozenset({"is_matryoshka", "matryoshka_dimensions"})


@dataclass
class LoadedModel:
    """Everything the engine needs from a checkpoint. ``tokenizer`` is None only when the source has no
    tokenizer files (e.g. a bare config.json for dummy weights)."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | None
    generation_config: dict[str, Any] = field(default_factory=dict)
    source: ModelSource | None = None
    pooling: str | None = None  # the embeddings' pooling the checkpoint declares (loader/pooling.py)
    matryoshka: Matryoshka = field(default_factory=Matryoshka)  # which truncated vector sizes it was trained for
    # The checkpoint ships no LM head (a base model saved for its embeddings): it serves embeddings only.
    embedding_only: bool = False


def load_model(
    source: ModelSource,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    yarn_scaling_factor: float | None = None,
    isq: str | None = None,
    hf_overrides: Mapping[str, Any] | None = None,
) -> LoadedModel:
    """Build the model for ``source`` on ``device`` in ``dtype`` and fill its weights (random for "dummy").

    ``isq`` (an ``--isq`` name such as ``q4k``) quantizes the decoder's linear weights to GGUF blocks one tensor
    at a time as they arrive, on ``device`` (see ``quant.isq``); embeddings and the LM head stay dense.
    ``hf_overrides`` (vLLM's ``--hf-overrides``) is laid over config.json; a GGUF's config comes from its metadata,
    so there it may only declare what the file cannot (``GGUF_OVERRIDES``).
    """
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r} (choose from {', '.join(LOAD_FORMATS)})")
    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported (use bf16, f16 or f32)")
    ckpt = gguf_io.open_gguf(list(source.weight_files)) if source.format == "gguf" else None
    overrides = hf_overrides or {}
    config = _gguf_config(ckpt, overrides) if ckpt is not None else _hf_config(source, overrides)
    if yarn_scaling_factor is not None:
        try:
            config = config.with_yarn_scaling(yarn_scaling_factor)
        except ValueError as e:
            raise ModelLoadError(str(e)) from e
    where = str(source.weight_files[0] if source.weight_files else source.config_dir)
    try:
        model = model_class(config)(config, dtype, device)
    except ValueError as e:
        raise ModelLoadError(f"{where}: {e}") from e
    expected = model.expected_weights()
    if load_format == "dummy" or source.format == "config":
        weights: Iterator[tuple[str, WeightData, Path | None]] = (
            (n, w, None) for n, w in dummy.dummy_weights(expected, dtype, device)
        )
    elif ckpt is not None:
        weights = gguf_io.iter_gguf_weights(ckpt, config, model.hf_name_from_gguf)
    else:
        assert source.config_dir is not None
        weights = safetensors_io.iter_tensors(safetensors_io.checkpoint_files(source.config_dir))
    if isq is not None:
        weights = _in_situ_quantized(weights, isq, device)
    headless = _fill(model, expected, weights, where, "Loading weights" + (f" (ISQ {isq})" if isq else ""))
    model.eval()
    metadata = ckpt.metadata if ckpt is not None else None
    return LoadedModel(model, config, _tokenizer(source, metadata), _generation_config(source), source,
                       declared_pooling(source, metadata), Matryoshka.of_config(config.extra), headless)


def _hf_config(source: ModelSource, overrides: Mapping[str, Any]) -> ModelConfig:
    assert source.config_dir is not None
    path = source.config_dir / "config.json"
    try:
        config = config_from_hf_dir(source.config_dir, overrides)
        Matryoshka.of_config(config.extra)
        return config
    except (OSError, ValueError, KeyError, TypeError) as e:
        where = f"{path} with --hf-overrides" if overrides else str(path)
        raise ModelLoadError(f"{where}: {type(e).__name__}: {e}") from e


def _gguf_config(ckpt: gguf_io.GGUFCheckpoint, overrides: Mapping[str, Any]) -> ModelConfig:
    """The GGUF's config with the embedding declarations of ``overrides``; anything else is refused (the file's
    metadata fixes the shapes, and an override of them would be ignored)."""
    unknown = sorted(set(overrides) - GGUF_OVERRIDES)
    if unknown:
        raise ModelLoadError(f"--hf-overrides {', '.join(unknown)}: a GGUF model's config comes from the file's "
                             f"metadata, so only {', '.join(sorted(GGUF_OVERRIDES))} can be overridden; drop the rest")
    config = gguf_io.gguf_config(ckpt)
    if not overrides:
        return config
    config = dataclasses.replace(config, extra=merged_config(config.extra, overrides))
    try:
        Matryoshka.of_config(config.extra)
    except ValueError as e:
        raise ModelLoadError(f"--hf-overrides: {e}") from e
    return config


def _in_situ_quantized(
    weights: Iterator[tuple[str, WeightData, Path | None]], isq: str, device: torch.device
) -> Iterator[tuple[str, WeightData, Path | None]]:
    """``weights`` with decoder linear weights quantized; a GGUF file's already quantized ones are refused
    (requantizing would silently compound two roundings)."""
    try:
        qtype = resolve_qtype(isq)
    except ValueError as e:
        raise ModelLoadError(str(e)) from e
    for name, w, f in weights:
        if not isinstance(w, torch.Tensor):
            if is_target(name, len(w.shape)):
                raise ModelLoadError(f"--isq {isq}: {f}: tensor {name} is already quantized ({w.qtype.name}); "
                                     "ISQ quantizes unquantized (bf16/f16/f32) weights, so drop --isq")
            yield name, w, f
            continue
        try:
            yield name, isq_weight(name, w, qtype, device), f
        except ValueError as e:
            raise ModelLoadError(f"--isq {isq}: {f or name}: tensor {name}: {e}") from e


def _fill(
    model: CausalLM,
    expected: dict[str, tuple[int, ...]],
    weights: Iterator[tuple[str, WeightData, Path | None]],
    where: str,
    desc: str = "Loading weights",
) -> bool:
    """Stream weights into the model with a progress bar; unknown tensors are skipped, missing ones fail, except
    a missing LM head: the head is then tied to the embedding (for the internal token of embedding requests) and
    True is returned (the model serves embeddings only)."""
    seen: set[str] = set()
    skipped: list[str] = []
    with torch.inference_mode(), tqdm(total=len(expected), desc=desc, unit="tensor",
                                       disable=None) as bar:
        for name, w, f in weights:
            if name not in expected and f"model.{name}" in expected:  # a base model's tensors (no "model." prefix)
                name = f"model.{name}"
            if name not in expected:
                skipped.append(name)
                continue
            try:
                model.load_weights([(name, w)])
            except (ValueError, KeyError) as e:
                raise ModelLoadError(f"{f or where}: tensor {name}: {e}") from e
            seen.add(name)
            bar.update(1)
    missing = [n for n in expected if n not in seen]
    headless = missing == ["lm_head.weight"]
    if headless:
        log.warning("%s has no lm_head.weight (a base model, as embedding checkpoints are saved): it serves "
                    "embeddings only; generation requests are refused", where)
        model.tie_lm_head()
        missing = []
    if missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{where}: missing tensor {', '.join(missing[:3])}{more}")
    model.finish_loading()
    if skipped:
        log.warning("ignored %d checkpoint tensors the model does not use (e.g. %s)", len(skipped), skipped[0])
    return headless


def _tokenizer(source: ModelSource, gguf_meta: dict[str, Any] | None) -> Tokenizer | None:
    """The tokenizer the checkpoint ships (GGUF metadata or tokenizer.json), None when it has none."""
    try:
        if gguf_meta is not None and "tokenizer.ggml.model" in gguf_meta:
            from candle_vllm.pyengine.tokenizer import load_tokenizer_from_gguf

            return load_tokenizer_from_gguf(source.weight_files[0])
        if source.config_dir is not None and (source.config_dir / "tokenizer.json").is_file():
            from candle_vllm.pyengine.tokenizer import load_tokenizer_from_hf_dir

            return load_tokenizer_from_hf_dir(source.config_dir)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"{source.name}: cannot load the tokenizer ({type(e).__name__}: {e})") from e
    log.warning("%s has no tokenizer files; only token-id prompts will work", source.name)
    return None


def _generation_config(source: ModelSource) -> dict[str, Any]:
    path = source.config_dir / "generation_config.json" if source.config_dir is not None else None
    if path is None or not path.is_file():
        return {}
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except ValueError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from e
