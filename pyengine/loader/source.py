"""Turn what the user asked for (``--m``, ``--w``, ``--f``) into local files: a ``ModelSource``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from candle_vllm.pyengine.loader.errors import ModelLoadError
from candle_vllm.pyengine.loader.gguf_shards import local_shards, pick_gguf

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass(frozen=True)
class ModelSource:
    """A model resolved to local paths.

    ``format`` is "safetensors", "gguf", or "config" (only a config.json: dummy weights). ``config_dir``
    holds config.json / tokenizer files / generation_config.json (None for a bare GGUF, which carries
    its own config and tokenizer).
    """

    name: str
    format: str
    weight_files: tuple[Path, ...]
    config_dir: Path | None


def resolve_model_source(
    model: str | None,
    weight_path: str | None = None,
    weight_file: str | None = None,
    hf_token: str | None = None,
    load_format: str = "auto",
) -> ModelSource:
    """Resolve ``--m`` (HF id, local dir, local .gguf), legacy ``--w`` (local dir) and ``--f`` (GGUF file or
    subfolder, relative to ``--m``/``--w``, or a local path on its own). Hub models come from the local HF
    cache first and are downloaded only when missing. ``hf_token`` is the token value itself."""
    if load_format not in LOAD_FORMATS:
        raise ModelLoadError(f"unknown load format {load_format!r} (choose from {', '.join(LOAD_FORMATS)})")
    if weight_path is not None:
        base = Path(weight_path).expanduser()
        return _local(base / weight_file if weight_file else base, model or weight_path, load_format)
    if model is None:
        if weight_file is None:
            raise ModelLoadError("no model given: pass --m <HF id | directory | file.gguf>")
        return _local(Path(weight_file).expanduser(), weight_file, load_format)
    path = Path(model).expanduser()
    if path.exists():
        return _local(path / weight_file if weight_file else path, model, load_format)
    if model.startswith(("/", "./", "../", "~")) or model.endswith(".gguf") or model.count("/") > 1:
        raise ModelLoadError(f"{model}: no such file or directory")
    from candle_vllm.pyengine.loader.hub import resolve_hub

    return resolve_hub(model, weight_file, hf_token, load_format)


def source_from_dir(path: Path, name: str, load_format: str) -> ModelSource:
    """A local model directory: safetensors + config.json, or GGUF file(s)."""
    has_config = (path / "config.json").is_file()
    safetensors = sorted(path.glob("*.safetensors"))
    ggufs = sorted(path.glob("*.gguf"))
    if load_format == "dummy" and has_config:
        return ModelSource(name, "config", (), path)
    if (safetensors or (path / "model.safetensors.index.json").is_file()) and load_format != "gguf":
        if not has_config:
            raise ModelLoadError(f"{path / 'config.json'}: missing (needed next to safetensors weights)")
        return ModelSource(name, "safetensors", tuple(safetensors), path)
    if ggufs and load_format != "safetensors":
        return ModelSource(name, "gguf", tuple(pick_gguf(ggufs, str(path))), None)
    raise ModelLoadError(f"{path}: no safetensors or GGUF weights found")


def _local(path: Path, name: str, load_format: str) -> ModelSource:
    if path.is_dir():
        return source_from_dir(path, name, load_format)
    if not path.exists():
        raise ModelLoadError(f"{path}: no such file or directory")
    if path.suffix != ".gguf":
        raise ModelLoadError(f"{path}: expected a .gguf file or a model directory")
    return ModelSource(name, "gguf", tuple(local_shards(path)), None)
