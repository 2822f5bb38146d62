"""resolve_model_source: local dirs and files, GGUF shards and folders, legacy flags, the HF cache."""

from __future__ import annotations

import shutil
from pathlib import Path

import huggingface_hub.constants
import pytest
from tiny_checkpoints import write_tiny_gguf

from candle_vllm.pyengine.loader import ModelLoadError, resolve_model_source


def test_safetensors_dir(hf_dir: Path) -> None:
    src = resolve_model_source(str(hf_dir))
    assert (src.format, src.config_dir, [f.name for f in src.weight_files]) == (
        "safetensors", hf_dir, ["model.safetensors"])


def test_single_gguf_file_and_dir(tmp_path: Path) -> None:
    f = write_tiny_gguf(tmp_path / "tiny-Q8.gguf")
    (tmp_path / "mmproj-tiny.gguf").write_bytes(b"vision tower, ignored")
    for given in (str(f), str(tmp_path)):
        src = resolve_model_source(given)
        assert (src.format, src.weight_files, src.config_dir) == ("gguf", (f,), None)


def test_split_gguf_discovered_from_first_shard_and_dir(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", split_max_tensors=8)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) == 3
    assert resolve_model_source(str(shards[0])).weight_files == tuple(shards)
    assert resolve_model_source(str(tmp_path)).weight_files == tuple(shards)
    shards[2].unlink()
    with pytest.raises(ModelLoadError, match=r"m-00003-of-00003\.gguf: missing GGUF shard"):
        resolve_model_source(str(shards[0]))


def test_dir_with_two_models_asks_for_f(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "a-Q4.gguf")
    shutil.copy(tmp_path / "a-Q4.gguf", tmp_path / "a-Q8.gguf")
    with pytest.raises(ModelLoadError, match=r"several GGUF models \(a-Q4.gguf, a-Q8.gguf\).*--f"):
        resolve_model_source(str(tmp_path))
    src = resolve_model_source(str(tmp_path), weight_file="a-Q8.gguf")
    assert src.weight_files == (tmp_path / "a-Q8.gguf",)


def test_legacy_weight_path_and_weight_file(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    f = write_tiny_gguf(tmp_path / "sub" / "x.gguf")
    assert resolve_model_source(None, weight_path=str(tmp_path / "sub")).weight_files == (f,)
    assert resolve_model_source(None, weight_path=str(tmp_path / "sub"), weight_file="x.gguf").weight_files == (f,)
    assert resolve_model_source(None, weight_file=str(f)).weight_files == (f,)
    assert resolve_model_source(str(tmp_path), weight_file="sub").weight_files == (f,)  # --m dir --f subfolder


@pytest.mark.parametrize("given,message", [
    ("/nonexistent/model", "no such file"),
    ("missing-model.gguf", "no such file"),
    ("not a repo!", "neither a local path nor a valid Hugging Face repo id"),
])
def test_bad_names_are_one_line_errors(given: str, message: str) -> None:
    with pytest.raises(ModelLoadError, match=message) as e:
        resolve_model_source(given)
    assert "\n" not in str(e.value)


def test_no_model_at_all() -> None:
    with pytest.raises(ModelLoadError, match="no model given"):
        resolve_model_source(None)


def test_text_file_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match=r"expected a \.gguf file or a model directory"):
        resolve_model_source(str(tmp_path / "weights.bin"))


def _fake_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, repo: str) -> Path:
    """An HF hub cache (huggingface_hub's documented layout) holding ``repo`` at one snapshot."""
    cache = tmp_path / "hub"
    folder = cache / f"models--{repo.replace('/', '--')}"
    snap = folder / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    return snap


def test_hub_repo_from_cache_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, hf_dir: Path) -> None:
    snap = _fake_cache(monkeypatch, tmp_path, "org/tiny")
    for f in hf_dir.iterdir():
        shutil.copy(f, snap / f.name)
    src = resolve_model_source("org/tiny")
    assert (src.format, src.name, src.config_dir) == ("safetensors", "org/tiny", snap)


def test_hub_gguf_file_from_cache_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    snap = _fake_cache(monkeypatch, tmp_path, "org/tiny-GGUF")
    f = write_tiny_gguf(snap / "tiny-Q8_0.gguf")
    src = resolve_model_source("org/tiny-GGUF", weight_file="tiny-Q8_0.gguf")
    assert (src.format, [p.resolve() for p in src.weight_files]) == ("gguf", [f.resolve()])


def test_hub_offline_miss_says_how_to_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _fake_cache(monkeypatch, tmp_path, "org/other")
    with pytest.raises(ModelLoadError, match="org/absent: not in the local Hugging Face cache") as e:
        resolve_model_source("org/absent")
    assert "local path" in str(e.value) and "\n" not in str(e.value)
