"""The dp4a GGUF Parts (native/cuda/gguf_q8*.cuh) run on the host against the `gguf` package's dequantizer.

The Parts are plain integer code whose CUDA intrinsics have host fallbacks; tests/native/host_parts/dot_rows.cpp
walks a weight row Part by Part as a GEMV thread does (fetch, decode, load_x, dot) with the host compiler, so their
decoding and scaling are checked in CI, without a GPU. Inputs: random GGUF blocks with finite f16 scales, random
int8 codes with random f32 block scales and their half sums (an XBlock each). Oracle: gguf's f32 dequantized
weights times the activation values (code * scale) in float64. The Parts take exact integer dot products and scale
them in f32, so they agree within f32 rounding: 1e-5 of sum(|w| * |x|) per row (a misplaced code or scale is off by
a large fraction of the row's magnitude).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

ROOT = Path(__file__).resolve().parents[2]
DRIVER = Path(__file__).with_name("host_parts")
PART_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q4_K, QT.Q5_K, QT.Q6_K]
SCALE_FIELDS = {  # byte offsets of each block's f16 scale fields (ggml-common.h)
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}
ROWS, COLS = 12, 1024
REL_F32 = 1e-5


@pytest.fixture(scope="module")
def dot_rows(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The driver built with the host C++ compiler."""
    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path_factory.mktemp("host_parts") / "dot_rows"
    subprocess.run(
        [cxx, "-std=c++17", "-O1", "-Wall", "-Wno-unknown-pragmas", "-Werror", f"-I{ROOT / 'native'}",
         f"-I{DRIVER}", str(DRIVER / "dot_rows.cpp"), "-o", str(exe)],
        check=True, capture_output=True, text=True,
    )
    return exe


def random_blocks(qtype: QT, rng: np.random.Generator) -> np.ndarray:
    """Raw GGUF bytes [ROWS, row_bytes]: random codes and packed scales, finite moderate f16 scale fields."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(ROWS, COLS // bs, ts), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        scale = rng.uniform(0.25, 1.0, size=raw.shape[:2]) * rng.choice([-1.0, 1.0], size=raw.shape[:2]) / 32
        raw[:, :, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(ROWS, -1)


def random_activation(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, bytes]:
    """int8 codes [COLS], f32 scales [COLS / 32] and the XBlocks (scale, code sums of each 16-value half)."""
    codes = rng.integers(-127, 128, size=COLS, dtype=np.int8)
    scales = rng.uniform(0.005, 0.05, size=COLS // 32).astype(np.float32)
    halves = codes.astype(np.int16).reshape(-1, 2, 16).sum(axis=2).astype(np.int16)
    xblocks = np.zeros(COLS // 32, dtype=[("d", "<f4"), ("sum", "<i2", (2,))])
    xblocks["d"], xblocks["sum"] = scales, halves
    return codes, scales, xblocks.tobytes()


def run_driver(exe: Path, tmp_path: Path, qtype: QT, payload: bytes) -> tuple[int, np.ndarray]:
    """The driver's exit code and its row sums for a weight and one token (``payload``) of ``qtype``."""
    src, dst = tmp_path / "in.bin", tmp_path / "out.bin"
    src.write_bytes(np.array([int(qtype), ROWS, COLS], dtype="<i4").tobytes() + payload)
    code = subprocess.run([str(exe), str(src), str(dst)], check=False).returncode
    return code, (np.fromfile(dst, dtype="<f8") if code == 0 else np.empty(0))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("qtype", PART_TYPES, ids=lambda t: t.name)
def test_part_dots_match_the_dequantized_rows(dot_rows: Path, tmp_path: Path, qtype: QT, seed: int) -> None:
    rng = np.random.default_rng(100 * int(qtype) + seed)
    raw = random_blocks(qtype, rng)
    codes, scales, xblocks = random_activation(rng)
    code, got = run_driver(dot_rows, tmp_path, qtype, raw.tobytes() + codes.tobytes() + xblocks)
    assert code == 0
    w = gguf.quants.dequantize(raw, qtype).astype(np.float64).reshape(ROWS, COLS)
    x = codes.astype(np.float64) * np.repeat(scales.astype(np.float64), 32)
    want, magnitude = w @ x, np.abs(w) @ np.abs(x)
    assert np.all(np.abs(got - want) <= REL_F32 * magnitude), np.max(np.abs(got - want) / magnitude)


def test_a_type_without_a_part_is_refused(dot_rows: Path, tmp_path: Path) -> None:
    code, _ = run_driver(dot_rows, tmp_path, QT.IQ4_NL, b"")
    assert code == 3
