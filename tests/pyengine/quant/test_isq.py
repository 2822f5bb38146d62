"""ISQ quantizer on CPU against outside oracles: llama.cpp's own quantizer (llama_model_quantize on an F32 GGUF,
all ten types, byte-exact), the gguf package's quantizer (the five types it implements, byte-exact) and
dequantizer, and per-type error bounds derived from each format's step size."""

from __future__ import annotations

import ctypes
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.ops.quant import dequantize, type_size
from candle_vllm.pyengine.quant.isq import ISQ_QTYPES, effective_qtype, quantize, resolve_qtype

LEGACY = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0"]
# Code levels per type, and whether the codes are symmetric around zero (scale from |max|) or span [min, max].
LEVELS = {"q4_0": 16, "q4_1": 16, "q5_0": 32, "q5_1": 32, "q8_0": 255, "q2k": 4, "q3k": 8, "q4k": 16, "q5k": 32,
          "q6k": 64}
SYMMETRIC = {"q4_0", "q5_0", "q8_0", "q3k", "q6k"}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* value for each type (Q4_K_S, Q5_K_S, Q3_K_S: with pure=True every 2-D
# tensor gets the base type).
LLAMA_FTYPE = {QT.Q4_0: 2, QT.Q4_1: 3, QT.Q8_0: 7, QT.Q5_0: 8, QT.Q5_1: 9, QT.Q2_K: 10, QT.Q3_K: 11, QT.Q4_K: 14,
               QT.Q5_K: 16, QT.Q6_K: 18}
ROWS, COLS = 96, 1024


def weights(seed: int, rows: int = ROWS, cols: int = COLS, tiny: bool = True) -> torch.Tensor:
    """Rows with magnitudes over ~3 decades, sparse 30x outliers, a negative-only row, a positive-only row, a
    constant row and (``tiny``) a row 1000x smaller whose f16 scales are subnormal."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp(torch.randn(rows, 1, generator=g) * 1.5) * 0.05
    w[::5, ::37] *= 30
    w[1] = -w[1].abs()
    w[2] = w[2].abs()
    w[3] = 0.37
    if tiny:
        w[4] *= 1e-3
    return w


def _llama_quantize(mats: list[np.ndarray], qtype: QT, tmp: Path) -> list[np.ndarray]:
    """Blocks llama.cpp writes for ``mats`` (as attn_q/attn_k/ffn_up of a one-layer F32 llama GGUF)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    names = ["blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_up.weight"][: len(mats)]
    hid = mats[0].shape[1]
    w = gguf.GGUFWriter(str(tmp / "f32.gguf"), "llama")
    w.add_context_length(64)
    w.add_embedding_length(hid)
    w.add_block_count(1)
    w.add_feed_forward_length(mats[0].shape[0])
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(0)
    w.add_tensor("token_embd.weight", np.ones((8, hid), np.float32))
    w.add_tensor("output_norm.weight", np.ones(hid, np.float32))
    for name, m in zip(names, mats, strict=True):
        w.add_tensor(name, m.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = LLAMA_FTYPE[qtype], True, 1
    rc = llama_cpp.llama_model_quantize(str(tmp / "f32.gguf").encode(), str(tmp / "q.gguf").encode(),
                                        ctypes.byref(params))
    assert rc == 0, f"llama_model_quantize failed ({rc})"
    tensors = {t.name: t for t in gguf.GGUFReader(str(tmp / "q.gguf")).tensors}
    out = []
    for name, m in zip(names, mats, strict=True):
        assert QT(tensors[name].tensor_type) == qtype
        out.append(np.array(tensors[name].data).reshape(m.shape[0], -1))
    return out


@pytest.mark.parametrize("name", list(ISQ_QTYPES))
def test_blocks_equal_llama_cpp(name: str, tmp_path: Path) -> None:
    """Byte-exact against llama.cpp for every type; the inputs are bf16 values, quantized from bf16 by us and
    from the same values in f32 by llama.cpp (so the bf16 input path is covered too)."""
    qtype = ISQ_QTYPES[name]
    mats = [weights(seed).to(torch.bfloat16) for seed in (1, 2)]
    want = _llama_quantize([m.float().numpy() for m in mats], qtype, tmp_path)
    for m, ref in zip(mats, want, strict=True):
        got = quantize(m, name).numpy()
        bad = (got.reshape(-1, type_size(qtype)) != ref.reshape(-1, type_size(qtype))).any(1)
        assert not bad.any(), f"{bad.sum()} of {bad.size} blocks differ from llama.cpp's"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", LEGACY)
def test_blocks_equal_gguf_package(name: str, dtype: torch.dtype) -> None:
    w = weights(3).to(dtype)
    want = gguf.quants.quantize(w.float().numpy(), ISQ_QTYPES[name])
    assert np.array_equal(quantize(w, name).numpy(), want)


def _block_views(w: torch.Tensor, deq: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = 256 if name.endswith("k") else 32
    return w.reshape(-1, n), (deq - w).reshape(-1, n)


@pytest.mark.parametrize("name", list(ISQ_QTYPES))
def test_dequantized_error_within_half_a_step(name: str) -> None:
    """Our dequantizer and gguf's agree exactly on the blocks; the RMSE of every block stays below half its
    quantization step. The step is 2*absmax/levels for symmetric codes and (max - min)/(levels - 1) for
    min/scale codes (K types: min clamped to <= 0, as their offset is); rounding to the nearest level gives
    |err| <= step/2 per value (RMSE ~ step/sqrt(12) on random data), and the clamped extreme of the symmetric
    types (one value per block at most one step off) stays inside the RMSE bound. Q4_1/Q5_1 store their offset as
    f16, which a constant block (step 0) shows alone."""
    qtype = ISQ_QTYPES[name]
    w = weights(4, tiny=False)  # subnormal f16 scales lose relative precision by the format's design
    blocks = quantize(w, name)
    ours = dequantize(blocks, qtype, tuple(w.shape))
    theirs = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype)).reshape(w.shape)
    assert torch.equal(ours, theirs)
    x, err = _block_views(w, ours, name)
    levels = LEVELS[name]
    if name in SYMMETRIC:
        step = 2 * x.abs().amax(1) / levels
    else:
        lo = x.amin(1) if name in ("q4_1", "q5_1") else x.amin(1).clamp(max=0)
        step = (x.amax(1) - lo) / (levels - 1)
    rmse = err.pow(2).mean(1).sqrt()
    bound = 0.5 * step
    if name in ("q4_1", "q5_1"):  # the offset m = min is stored as f16: off by up to |min| * 2^-11
        bound = bound + lo.abs() * 2**-11
    assert (rmse <= bound).all(), f"worst RMSE / step = {(rmse / step.clamp(min=1e-30)).max().item():.3f}"


def test_q8_0_every_value_within_half_its_scale() -> None:
    """Q8_0: |err| <= d/2 per value for the f32 scale d = absmax/127; the stored scale is that d rounded to
    f16 (relative error <= 2^-11), which moves a code-127 value by at most 127 * d * 2^-11 more."""
    w = weights(5, tiny=False)
    blocks = quantize(w, "q8_0")
    err = (dequantize(blocks, QT.Q8_0, tuple(w.shape)) - w).reshape(-1, 32).abs().amax(1)
    d = w.reshape(-1, 32).abs().amax(1) / 127
    assert (err <= d * (0.5 + 127 * 2**-11) * (1 + 1e-6)).all()


def test_rows_of_partial_super_blocks_fall_back_like_llama_cpp() -> None:
    assert effective_qtype(QT.Q4_K, 4096) == QT.Q4_K
    assert effective_qtype(QT.Q4_K, 96) == QT.Q5_0
    assert effective_qtype(QT.Q6_K, 96) == QT.Q8_0
    assert effective_qtype(QT.Q8_0, 48) is None


@pytest.mark.parametrize(
    ("weight", "qtype", "message"),
    [
        (torch.randn(4, 100), "q8_0", "whole number of 32-element blocks"),
        (torch.randn(4, 128), "q4k", "whole number of 256-element blocks"),
        (torch.randn(128), "q8_0", "2-D"),
        (torch.randint(0, 3, (4, 64)), "q8_0", "f32/f16/bf16"),
        (torch.full((4, 64), float("nan")), "q8_0", "NaN or infinite"),
        (torch.randn(4, 64), "q9k", "unknown ISQ type 'q9k'"),
    ],
)
def test_unsupported_inputs_raise(weight: torch.Tensor, qtype: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(weight, qtype)


@pytest.mark.parametrize("name", list(ISQ_QTYPES))
def test_weights_too_large_for_f16_scales_are_refused(name: str) -> None:
    """Finite weights whose block scales overflow f16 (inf scales, NaN outputs) are a clear error; values just
    inside the range still quantize."""
    w = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    with pytest.raises(ValueError, match="overflows the f16 block scales"):
        quantize(w * 1e9, name)
    quantize(w * 100.0, name)


def test_resolve_qtype_refuses_types_isq_does_not_make() -> None:
    assert resolve_qtype("q4k") == QT.Q4_K
    with pytest.raises(ValueError, match="IQ4_NL"):
        resolve_qtype(QT.IQ4_NL)
