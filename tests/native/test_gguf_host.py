"""The GGUF CUDA kernels' integer code on the host, against the `gguf` package's dequantizer.

The dequantize decoders (native/cuda/gguf_decode*.cuh), the dp4a Parts (gguf_q8*.cuh) and the tile loaders of the
tensor-core product (gguf_mmq_*.cuh) are plain integer and f32 code whose CUDA intrinsics have host fallbacks; the
drivers in tests/native/host_parts run them with the host compiler, so their decoding and scaling are checked in CI,
without a GPU. Inputs: random GGUF blocks with finite f16 scales (test_cuda_gguf.random_blocks); for the Parts,
random int8 codes with random f32 block scales and their half sums (an XBlock each).

The drivers are built with AddressSanitizer where the compiler has it and hold the weight in an allocation of exactly
its size: an odd number of rows of an odd number of blocks ends the tensor on a block that starts 2 bytes off a word
(Q4_0's 18-byte blocks), where a loader reading the words around its bytes would read past the tensor (what the GPU's
memcheck found in session 10), or on a short group of the grouped types. The weights go in as the CUDA kernels store
them (``cuda_gguf.device_layout``: the rows of Q6_K, Q3_K, Q8_0 and Q5_0 regrouped so their loads are 16-byte
aligned; with 11 or 33 blocks per row, a row ends on a short group) and are compared with gguf's decoding of the GGUF
bytes.

- Decoders (dequant_rows.cpp decodes every 32-element slice as the dequantize / get_rows kernel's thread does):
  equal to gguf's f32 dequantized weights bit for bit (they repeat its f32 operations; built without contraction).
  Their GEMV view (gemv_weights.cpp: the codes and scales each lane hands the f16/bf16 tensor-core GEMV, at the
  elements elem() names): gguf's weights within f32 rounding, as for the tile loaders below.
- Parts (dot_rows.cpp walks a weight row Part by Part as a GEMV thread does: fetch, decode, load_x, dot): against
  gguf's f32 dequantized weights times the activation values (code * scale) in float64. They take exact integer dot
  products and scale them in f32, so they agree within f32 rounding: 1e-5 of sum(|w| * |x|) per row (a misplaced
  code or scale is off by a large fraction of the row's magnitude).
- Tile loaders (tile_weights.cpp rebuilds every weight from the codes and scales each lane hands the mma, at the
  element the loader contract gives that lane's slot): against gguf's dequantized weights, within f32 rounding
  (1e-6 of each weight's magnitude plus its row's largest, which bounds the scale and min terms).
- The tensor-core product's arithmetic (mma_rows.cpp runs gguf_mmq_arith.cuh's multiply_unit / multiply_unit_k with
  a warp's lanes as threads and mma.sync emulated from the PTX fragment layouts): against gguf's weights times the
  activation values in float64 within f32 rounding as for the Parts, in every launch shape, which must also give
  the same bits as each other (which path a unit takes may not change a token's result).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from test_cuda_gguf import random_blocks

from candle_vllm.pyengine.ops import cuda_gguf

ROOT = Path(__file__).resolve().parents[2]
DRIVERS = Path(__file__).with_name("host_parts")
DEQUANT_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
PART_TYPES = TILE_TYPES = DEQUANT_TYPES
ROWS = 13
REL_F32 = 1e-5
REL_SCALE = 1e-6
Build = Callable[[str], Path]  # the driver fixture: a driver's name -> its executable


def cols_for(qtype: QT, tiles: bool) -> int:
    """Odd blocks per row where the kernel allows it: the tensor-core product takes whole 256-element units. Q6_K's
    and Q3_K's 11 blocks (and the 32-element types' 33) are whole groups of their CUDA layout and a short one."""
    if qtype in (QT.Q6_K, QT.Q3_K):
        return 256 * 11
    return 768 if tiles or gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 32 * 33


@pytest.fixture(scope="module")
def driver(tmp_path_factory: pytest.TempPathFactory) -> Build:
    """driver(name): tests/native/host_parts/<name>.cpp built once with the host C++ compiler, with AddressSanitizer
    where the compiler has it."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    built: dict[str, Path] = {}

    def build(name: str) -> Path:
        if name not in built:
            exe = tmp_path_factory.mktemp("host_parts") / name
            flags = ["-std=c++17", "-O1", "-g", "-ffp-contract=off", "-Wall", "-Wno-unknown-pragmas", "-Werror",
                     f"-I{ROOT / 'native'}", f"-I{DRIVERS}", str(DRIVERS / f"{name}.cpp"), "-o", str(exe)]
            asan = subprocess.run([cxx, "-fsanitize=address", "-fno-omit-frame-pointer", *flags],
                                  capture_output=True, text=True)
            if asan.returncode != 0:
                subprocess.run([cxx, *flags], check=True, capture_output=True, text=True)
            built[name] = exe
        return built[name]

    return build


def random_activation(cols: int, rng: np.random.Generator, group: int = 32) -> tuple[np.ndarray, np.ndarray, bytes]:
    """int8 codes [cols], f32 scales [cols / 32] (one per ``group`` values: 256 for the K-quants' tensor-core
    product) and the XBlocks (scale, code sums of each 16-value half)."""
    codes = rng.integers(-127, 128, size=cols, dtype=np.int8)
    scales = np.repeat(rng.uniform(0.005, 0.05, size=cols // group), group // 32).astype(np.float32)
    halves = codes.astype(np.int16).reshape(-1, 2, 16).sum(axis=2).astype(np.int16)
    xblocks = np.zeros(cols // 32, dtype=[("d", "<f4"), ("sum", "<i2", (2,))])
    xblocks["d"], xblocks["sum"] = scales, halves
    return codes, scales, xblocks.tobytes()


def stored(raw: np.ndarray, qtype: QT, cols: int) -> bytes:
    """The weight bytes as the CUDA kernels read them (``cuda_gguf.device_layout``: the grouped types regrouped)."""
    return cuda_gguf.device_layout(torch.from_numpy(raw), qtype, ROWS, cols).numpy().tobytes()


def run_driver(
    exe: Path, tmp_path: Path, qtype: QT, cols: int, payload: bytes, out: str = "<f8"
) -> tuple[int, np.ndarray, str]:
    """A driver's exit code, output (``out``: its numpy dtype) and stderr for ``payload`` (the weight bytes, and for
    dot_rows one token)."""
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(np.array([int(qtype), ROWS, cols], dtype="<i4").tobytes() + payload)
    run = subprocess.run([str(exe), str(src), str(dst)], check=False, capture_output=True, text=True)
    return run.returncode, (np.fromfile(dst, dtype=out) if run.returncode == 0 else np.empty(0)), run.stderr


@pytest.mark.parametrize("qtype", DEQUANT_TYPES, ids=lambda t: t.name)
def test_decoders_equal_the_dequantized_rows(driver: Build, tmp_path: Path, qtype: QT) -> None:
    cols = cols_for(qtype, tiles=False)
    raw = random_blocks(qtype, ROWS, cols, seed=int(qtype))
    code, got, err = run_driver(driver("dequant_rows"), tmp_path, qtype, cols, stored(raw, qtype, cols), out="<f4")
    assert code == 0, err
    want = gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(-1)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), np.max(np.abs(got - want))


@pytest.mark.parametrize("qtype", DEQUANT_TYPES, ids=lambda t: t.name)
def test_gemv_decoders_give_the_dequantized_weights(driver: Build, tmp_path: Path, qtype: QT) -> None:
    cols = cols_for(qtype, tiles=False)
    raw = random_blocks(qtype, ROWS, cols, seed=int(qtype) + 50)
    code, got, err = run_driver(driver("gemv_weights"), tmp_path, qtype, cols, stored(raw, qtype, cols))
    assert code == 0, err
    assert_weights_within_rounding(got, raw, qtype, cols)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", PART_TYPES, ids=lambda t: t.name)
def test_part_dots_match_the_dequantized_rows(driver: Build, tmp_path: Path, qtype: QT, seed: int) -> None:
    cols = cols_for(qtype, tiles=False)
    raw = random_blocks(qtype, ROWS, cols, seed=100 * int(qtype) + seed)
    codes, scales, xblocks = random_activation(cols, np.random.default_rng(seed))
    payload = stored(raw, qtype, cols) + codes.tobytes() + xblocks
    code, got, err = run_driver(driver("dot_rows"), tmp_path, qtype, cols, payload)
    assert code == 0, err
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(ROWS, cols)
    x = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), 32)
    want, magnitude = w @ x, np.abs(w) @ np.abs(x)
    assert np.all(np.abs(got - want) <= REL_F32 * magnitude), np.max(np.abs(got - want) / magnitude)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_tile_loaders_give_the_dequantized_weights(driver: Build, tmp_path: Path, qtype: QT, seed: int) -> None:
    cols = cols_for(qtype, tiles=True)
    raw = random_blocks(qtype, ROWS, cols, seed=100 * int(qtype) + seed)
    code, got, err = run_driver(driver("tile_weights"), tmp_path, qtype, cols, stored(raw, qtype, cols))
    assert code == 0, err
    assert_weights_within_rounding(got, raw, qtype, cols)


MMA_SHAPES = 9  # mma_rows.cpp's kShapes
MMA_TOKENS = 5  # fewer than a token tile: the tiles' spare rows repeat the last token, as in the kernels


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", TILE_TYPES, ids=lambda t: t.name)
def test_tensor_core_product_matches_the_dequantized_rows(driver: Build, tmp_path: Path, qtype: QT, seed: int) -> None:
    cols = cols_for(qtype, tiles=True)
    raw = random_blocks(qtype, ROWS, cols, seed=100 * int(qtype) + seed + 7)
    rng = np.random.default_rng(seed)
    group = 256 if gguf.GGML_QUANT_SIZES[qtype][0] == 256 else 32
    tokens = [random_activation(cols, rng, group) for _ in range(MMA_TOKENS)]
    payload = (stored(raw, qtype, cols) + np.int32(MMA_TOKENS).tobytes() + b"".join(c.tobytes() for c, _, _ in tokens)
               + b"".join(xb for _, _, xb in tokens))
    code, got, err = run_driver(driver("mma_rows"), tmp_path, qtype, cols, payload)
    assert code == 0, err
    got = got.reshape(MMA_SHAPES, MMA_TOKENS, ROWS)
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(ROWS, cols)
    x = np.stack([c.astype(np.float64) * np.repeat(s.astype(np.float64), 32) for c, s, _ in tokens])
    want, magnitude = x @ w.T, np.abs(x) @ np.abs(w).T
    assert np.all(np.abs(got - want) <= REL_F32 * magnitude), np.max(np.abs(got - want) / magnitude)
    for shape in range(1, MMA_SHAPES):
        assert np.array_equal(got[shape].view(np.uint64), got[0].view(np.uint64)), shape


def assert_weights_within_rounding(got: np.ndarray, raw: np.ndarray, qtype: QT, cols: int) -> None:
    """``got`` (f64, [ROWS * cols]) equals gguf's dequantized ``raw`` within f32 rounding of the scales."""
    got, want = got.reshape(ROWS, cols), gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(ROWS, cols)
    bound = REL_SCALE * (np.abs(want) + np.abs(want).max(axis=1, keepdims=True))
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want))


@pytest.mark.parametrize("name", ["dequant_rows", "gemv_weights", "dot_rows", "tile_weights", "mma_rows"])
def test_a_type_without_a_kernel_is_refused(driver: Build, tmp_path: Path, name: str) -> None:
    code, _, _ = run_driver(driver(name), tmp_path, QT.IQ4_NL, 256, b"")
    assert code == 3
