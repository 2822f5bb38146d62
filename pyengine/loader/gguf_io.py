"""Reading GGUF checkpoints (one file or split shards): metadata, config and weights in HF naming.

Quantized tensors stay as their raw blocks (``GGUFWeight``); F32/F16/BF16 tensors become plain tensors.
llama.cpp's converter permutes the rows of Llama-architecture q/k weights for its adjacent-pair RoPE; we
undo that here so one (HF, neox-style) RoPE serves every checkpoint. Qwen2/Qwen3 files are not permuted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, ReaderTensor

from candle_vllm.pyengine.config import ModelConfig, config_from_gguf_metadata
from candle_vllm.pyengine.loader.errors import ModelLoadError
from candle_vllm.pyengine.quant import GGUFWeight, WeightData

DENSE = {QT.F32: torch.float32, QT.F16: torch.float16, QT.BF16: torch.bfloat16}
_MAX_ARRAY = 1024  # metadata arrays longer than this (tokenizer vocab/merges) are left to the tokenizer


@dataclass
class GGUFCheckpoint:
    """All shards of one GGUF model, opened (memory-mapped)."""

    files: list[Path]
    metadata: dict[str, Any]
    tensors: dict[str, tuple[ReaderTensor, Path]]


def _field_value(field: Any) -> Any:
    if field.types and field.types[0] == GGUFValueType.ARRAY and len(field.data) > _MAX_ARRAY:
        return None
    return field.contents()


def open_gguf(files: list[Path]) -> GGUFCheckpoint:
    """Open every shard; metadata comes from the first. Bad magic, truncation or a wrong shard count -> error."""
    metadata: dict[str, Any] = {}
    tensors: dict[str, tuple[ReaderTensor, Path]] = {}
    for i, f in enumerate(files):
        try:
            reader = GGUFReader(f)
        except Exception as e:
            detail = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ModelLoadError(f"{f}: not a valid GGUF file ({detail}; corrupt or truncated?)") from e
        if i == 0:
            metadata = {k: v for k, fld in reader.fields.items() if (v := _field_value(fld)) is not None}
        size = f.stat().st_size
        for t in reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelLoadError(f"{f}: tensor {t.name} extends past the end of the file (truncated?)")
            tensors[t.name] = (t, f)
    count = int(metadata.get("split.count", 1))
    if count != len(files):
        raise ModelLoadError(f"{files[0]}: the model is split into {count} files but {len(files)} were found")
    return GGUFCheckpoint(files, metadata, tensors)


def _to_weight(t: ReaderTensor) -> WeightData:
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    raw = torch.from_numpy(np.array(t.data, copy=True))
    if t.tensor_type in DENSE:
        return raw.view(torch.uint8).view(DENSE[t.tensor_type]).reshape(shape)
    if t.tensor_type in (QT.F64, QT.I8, QT.I16, QT.I32, QT.I64):
        raise ValueError(f"tensor type {t.tensor_type.name} is not supported for weights")
    rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
    return GGUFWeight(raw.view(torch.uint8).reshape(rows, -1), t.tensor_type, shape)


def gguf_config(ckpt: GGUFCheckpoint) -> ModelConfig:
    """ModelConfig from the metadata and tensor table (plus llama3 ``rope_freqs`` factors when present)."""
    shapes = {name: tuple(int(d) for d in reversed(t.shape.tolist())) for name, (t, _) in ckpt.tensors.items()}
    factors = None
    if "rope_freqs.weight" in ckpt.tensors:
        factors = np.asarray(ckpt.tensors["rope_freqs.weight"][0].data, dtype=np.float32).tolist()
    try:
        return config_from_gguf_metadata(ckpt.metadata, shapes, factors)
    except (ValueError, KeyError) as e:
        raise ModelLoadError(f"{ckpt.files[0]}: {e}") from e


def _unpermute_rows(w: WeightData, n_head: int) -> WeightData:
    """Invert llama.cpp's q/k row permutation (per head: pairs interleaved -> halves)."""
    data = w if isinstance(w, torch.Tensor) else w.data
    rows = data.shape[0]
    fixed = data.reshape(n_head, rows // n_head // 2, 2, *data.shape[1:]).transpose(1, 2).reshape(data.shape)
    return fixed if isinstance(w, torch.Tensor) else GGUFWeight(fixed, w.qtype, w.shape)


def iter_gguf_weights(
    ckpt: GGUFCheckpoint, config: ModelConfig, name_map: Callable[[str], str | None]
) -> Iterator[tuple[str, WeightData, Path]]:
    """(HF name, weight, file) for every tensor ``name_map`` (GGUF name -> HF name or None) knows."""
    permuted = ckpt.metadata.get("general.architecture") == "llama"
    for gguf_name, (t, f) in ckpt.tensors.items():
        name = name_map(gguf_name)
        if name is None:
            continue
        try:
            w = _to_weight(t)
        except ValueError as e:
            raise ModelLoadError(f"{f}: tensor {gguf_name}: {e}") from e
        if permuted and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            w = _unpermute_rows(w, config.num_heads if ".attn_q." in gguf_name else config.num_kv_heads)
        yield name, w, f
