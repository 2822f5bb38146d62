"""GGUF checkpoints written with the ``gguf`` package from transformers models, loaded by our GGUF loader,
against transformers given the same (rounded/quantized) weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tiny_gguf import write_gguf
from tiny_models import hf_logits, make_hf_model

from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.ops.attention import AttentionMetadata

CPU = torch.device("cpu")


def _compare(
    hf_case: str, arch: str, tmp_path: Path, tol: float, qtype_of: Callable[[str], QT] | None = None, split: int = 0
) -> None:
    hf = make_hf_model(hf_case, seed=3)
    kwargs = {"qtype_of": qtype_of} if qtype_of else {}
    stored = write_gguf(hf, tmp_path / "model.gguf", arch, split_max_tensors=split, **kwargs)
    hf.load_state_dict(stored)
    files = sorted(tmp_path.glob("*.gguf"))
    loaded = load_model(resolve_model_source(str(files[0])), torch.float32, CPU)
    assert loaded.config.source_format == "gguf"
    model = loaded.model
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 256, (30,), generator=g)
    with torch.inference_mode():
        got = model.compute_logits(model(ids, torch.arange(30), AttentionMetadata.build([30])))
    want = hf_logits(hf, ids)
    assert want.std() > 0.5
    diff = (got - want).abs().max().item()
    assert diff <= tol, f"max |logit diff| {diff} > {tol}"


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16])
def test_llama_gguf_with_permuted_qk(qtype: QT, tmp_path: Path) -> None:
    _compare("llama", "llama", tmp_path, 1e-4, lambda name: qtype)


def test_tied_llama_gguf_without_output_tensor(tmp_path: Path) -> None:
    _compare("smollm_tied", "llama", tmp_path, 1e-4)


def test_qwen2_gguf_is_not_permuted_and_has_bias(tmp_path: Path) -> None:
    _compare("qwen2_bias", "qwen2", tmp_path, 1e-4)


def test_qwen3_gguf_with_qk_norm(tmp_path: Path) -> None:
    _compare("qwen3_qk_norm", "qwen3", tmp_path, 1e-4, lambda name: QT.F16)


def test_split_gguf_loads_from_first_shard(tmp_path: Path) -> None:
    _compare("llama", "llama", tmp_path, 1e-4, split=7)
    assert len(list(tmp_path.glob("model-0000?-of-0000?.gguf"))) > 1


def test_quantized_gguf_mixed_types_and_quantized_tied_embedding(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Q8_0 q/k/embedding, Q4_0 v (q/k/v then run as two matmuls), Q5_1 MLP. The oracle gets the gguf
    package's dequantized weights, so the wiring is checked exactly on the reference ops (dequantize + f32
    matmul); the native kernels quantize activations to 8 bits per block, which tests/pyengine/ops/
    test_quant.py bounds separately."""
    monkeypatch.setenv("CANDLE_VLLM_OPS", "reference")

    def qtype_of(name: str) -> QT:
        if ".attn_v." in name:
            return QT.Q4_0
        return QT.Q5_1 if ".ffn_" in name else QT.Q8_0

    _compare("smollm_tied", "llama", tmp_path, 1e-4, qtype_of)
