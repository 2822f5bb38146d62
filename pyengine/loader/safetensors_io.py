"""Reading safetensors checkpoints (single file or sharded with an index) with one-line errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from candle_vllm.pyengine.loader.errors import ModelLoadError

INDEX_NAME = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The weight files of ``model_dir``: the index's shards (each must exist), else every *.safetensors."""
    index = model_dir / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"{f}: missing checkpoint shard (listed in {INDEX_NAME})")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no *.safetensors files")
    return files


def tensor_names(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> file, reading only the headers (validates each file's header and size)."""
    names: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                names.update(dict.fromkeys(st.keys(), f))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({_first_line(e)}; truncated download?)") from e
    return names


def iter_tensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor, Path]]:
    """(name, tensor, file) for every tensor, one file open at a time."""
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    yield name, st.get_tensor(name), f
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f}: unreadable safetensors file ({_first_line(e)})") from e


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
