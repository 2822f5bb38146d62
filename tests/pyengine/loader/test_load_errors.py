"""load_model on broken or unusual inputs: one-line ModelLoadErrors naming the file; dummy weights;
the YaRN override."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import cast

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_checkpoints import write_tiny_gguf

from candle_vllm.pyengine.loader import ModelLoadError, load_model, resolve_model_source
from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.ops.attention import AttentionMetadata

CPU = torch.device("cpu")


def _load_error(path: Path, **kwargs: object) -> str:
    with pytest.raises(ModelLoadError) as e:
        load_model(resolve_model_source(str(path)), torch.float32, CPU, **kwargs)  # type: ignore[arg-type]
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_truncated_safetensors_header(hf_dir: Path) -> None:
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:20])
    assert "model.safetensors: unreadable safetensors file" in _load_error(hf_dir)


def test_safetensors_data_past_eof(hf_dir: Path) -> None:
    f = hf_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    assert "model.safetensors: unreadable safetensors file" in _load_error(hf_dir)


def test_missing_shard_listed_in_index(hf_dir: Path) -> None:
    tensors = load_file(hf_dir / "model.safetensors")
    names = sorted(tensors)
    (hf_dir / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[:5]}, hf_dir / "model-00001-of-00002.safetensors")
    weight_map = {n: "model-00001-of-00002.safetensors" if i < 5 else "model-00002-of-00002.safetensors"
                  for i, n in enumerate(names)}
    (hf_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert "model-00002-of-00002.safetensors: missing checkpoint shard" in _load_error(hf_dir)


def test_missing_and_misshapen_tensors(hf_dir: Path) -> None:
    f = hf_dir / "model.safetensors"
    tensors = load_file(f)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f)
    assert "missing tensor model.layers.1.mlp.up_proj.weight" in _load_error(hf_dir)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.randn(3, 3)
    save_file(tensors, f)
    msg = _load_error(hf_dir)
    assert "tensor model.layers.1.mlp.up_proj.weight" in msg and "[3, 3]" in msg


def test_unsupported_hf_architecture(hf_dir: Path) -> None:
    cfg = json.loads((hf_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (hf_dir / "config.json").write_text(json.dumps(cfg))
    assert "architecture 'GPT2LMHeadModel' is not supported" in _load_error(hf_dir)


def test_gguf_bad_magic_and_truncation(tmp_path: Path) -> None:
    f = write_tiny_gguf(tmp_path / "m.gguf")
    data = f.read_bytes()
    f.write_bytes(b"NOPE" + data[4:])
    assert "m.gguf: not a valid GGUF file" in _load_error(f)
    f.write_bytes(data[: len(data) - 500])
    msg = _load_error(f)
    assert "m.gguf" in msg and ("truncated" in msg or "not a valid GGUF" in msg)


def test_gguf_unsupported_architecture(tmp_path: Path) -> None:
    f = write_tiny_gguf(tmp_path / "m.gguf", arch="gpt2")
    assert "GGUF architecture 'gpt2' is not supported" in _load_error(f)


def test_gguf_shard_count_mismatch(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", split_max_tensors=8)
    # rename the first shard so discovery finds a 1-file "split" whose metadata says 3
    shutil.move(tmp_path / "m-00001-of-00003.gguf", tmp_path / "single.gguf")
    assert "split into 3 files but 1 were found" in _load_error(tmp_path / "single.gguf")


def test_unknown_load_format_and_dtype(hf_dir: Path) -> None:
    assert "unknown load format 'pt'" in _load_error(hf_dir, load_format="pt")
    with pytest.raises(ModelLoadError, match=r"dtype torch\.int8 is not supported"):
        load_model(resolve_model_source(str(hf_dir)), torch.int8, CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_weights_from_config_only(hf_dir: Path, dtype: torch.dtype) -> None:
    (hf_dir / "model.safetensors").unlink()
    src = resolve_model_source(str(hf_dir), load_format="dummy")
    assert src.format == "config"
    logits = []
    for _ in range(2):
        m = load_model(src, dtype, CPU, load_format="dummy").model
        ids = torch.arange(10)
        with torch.inference_mode():
            logits.append(m.compute_logits(m(ids, ids, AttentionMetadata.build([10]))))
    assert torch.isfinite(logits[0]).all()
    assert 0.1 < logits[0].std().item() < 100
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_yarn_override_rescales_context(hf_dir: Path) -> None:
    loaded = load_model(resolve_model_source(str(hf_dir)), torch.float32, CPU, yarn_scaling_factor=4.0)
    assert loaded.config.rope_scaling == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert loaded.config.max_position_embeddings == 256
    assert "must be > 1.0" in _load_error(hf_dir, yarn_scaling_factor=0.5)


def test_gguf_llama3_rope_freqs_tensor_becomes_freq_factors(tmp_path: Path) -> None:
    """Llama 3.1 GGUFs carry llama3 RoPE scaling as a ``rope_freqs`` tensor, not as metadata."""
    f = write_tiny_gguf(tmp_path / "m.gguf")
    reader = gguf.GGUFReader(f)
    factors = np.linspace(1.0, 8.0, 8).astype(np.float32)
    w = gguf.GGUFWriter(tmp_path / "r.gguf", "llama")
    for field in reader.fields.values():
        if field.name.startswith("llama."):
            w.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        w.add_tensor(t.name, np.array(t.data))
    w.add_tensor("rope_freqs.weight", factors)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    loaded = load_model(resolve_model_source(str(tmp_path / "r.gguf")), torch.float32, CPU)
    assert loaded.config.rope_freq_factors == pytest.approx(factors.tolist())
    cache = cast(LlamaForCausalLM, loaded.model).model.layers[0].self_attn.rotary.cos_sin_cache
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16)) / torch.from_numpy(factors)
    torch.testing.assert_close(cache[5, :8], torch.cos(5 * inv), atol=1e-6, rtol=1e-6)
