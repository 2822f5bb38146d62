"""The fused native CPU decoder stack (ops/cpu_decoder.py) against the op-by-op path, bitwise: hidden states of
every step and every layer's KV cache, on tiny random Llama-family models with GGUF-block weights (F32 and
quantized, q/k and v in different types, GQA, q/k norm, qkv bias, sliding window, both RoPE layouts, several
sequences crossing block boundaries, output rows) and on the real SmolLM2 GGUF. The F32 case is also checked
against transformers, so the fused path is not only self-consistent."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from tiny_models import hf_logits, make_hf_model, save_hf_model

from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.loader.embedded import default_model_path
from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.cpu_decoder import CpuDecoderStack
from candle_vllm.pyengine.quant import GGUFWeight

pytestmark = pytest.mark.skipif(native.module() is None, reason="needs the native module")
CPU = torch.device("cpu")
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _as_gguf(t: torch.Tensor, qtype: QT) -> GGUFWeight:
    """A dense [out, in] weight as GGUF blocks: F32 bytes as they are, other types through the gguf package."""
    arr = t.float().numpy()
    data = arr if qtype == QT.F32 else gguf.quants.quantize(arr, qtype)
    blocks = torch.from_numpy(data.copy()).view(torch.uint8).reshape(arr.shape[0], -1)
    return GGUFWeight(blocks, qtype, tuple(arr.shape))


def _gguf_model(case: str, tmp_path: Path, qtype_of: dict[str, QT], seed: int = 0) -> tuple[LlamaForCausalLM, object]:
    """Our model of a random transformers model, every projection re-loaded as GGUF blocks."""
    hf = make_hf_model(case, seed=seed)
    model = cast(LlamaForCausalLM,
                 load_model(resolve_model_source(str(save_hf_model(hf, tmp_path))), torch.float32, CPU).model)
    sd = hf.state_dict()
    model.load_weights(
        (name, _as_gguf(w, qtype_of.get(name.split(".")[-2], QT.F32)))
        for name, w in sd.items()
        if name.split(".")[-2] in _PROJ and name.endswith(".weight")
    )
    return model, hf


def _count_fused_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps the fused stack runs (a spy around the real method)."""
    calls: list[int] = []
    real = CpuDecoderStack.run

    def spy(self: CpuDecoderStack, x: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append(x.shape[0])
        return real(self, x, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(CpuDecoderStack, "run", spy)
    return calls


def _run_schedule(
    model: LlamaForCausalLM, fused: bool, caches: list[torch.Tensor], seqs: list[torch.Tensor],
    schedules: list[list[int]], tables: list[list[int]], block_size: int,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Advance the sequences by the schedule (new tokens per step each; odd steps ask for the sequences' last
    rows only); returns every step's hidden states and the final caches."""
    model.use_cpu_decoder_stack = fused
    model.kv_caches = [c.clone() for c in caches]
    done = [0] * len(seqs)
    outs = []
    for step in range(max(len(s) for s in schedules)):
        active = [i for i in range(len(seqs)) if step < len(schedules[i])]
        qlens = [schedules[i][step] for i in active]
        meta = AttentionMetadata.build(
            qlens, [done[i] + q for i, q in zip(active, qlens, strict=True)], "cpu", [tables[i] for i in active],
            block_size,
        )
        ids = torch.cat([seqs[i][done[i] : done[i] + q] for i, q in zip(active, qlens, strict=True)])
        pos = torch.cat([torch.arange(done[i], done[i] + q) for i, q in zip(active, qlens, strict=True)])
        assert meta.query_start_loc_cpu is not None
        rows = torch.tensor(meta.query_start_loc_cpu[1:]) - 1 if step % 2 else None
        with torch.inference_mode():
            outs.append(model(ids, pos, meta, output_rows=rows))
        for i, q in zip(active, qlens, strict=True):
            done[i] += q
    assert model.cpu_decoder_stack() is not None, "the fused stack did not accept this model"
    return outs, model.kv_caches


def _assert_fused_equals_unfused(model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int,
                                 kv_dtype: torch.dtype = torch.float32, turbo: str | None = None) -> None:
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    if turbo is not None:  # garbage bytes outside the written rows, as the dense caches' random values
        row = TurboFormat(turbo, cfg.head_dim).row_bytes
        caches = [torch.randint(0, 256, (1, num_blocks, block_size, cfg.num_kv_heads, row), generator=g,
                                dtype=torch.uint8) for _ in range(cfg.num_layers)]
    else:
        caches = [torch.randn(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g).to(kv_dtype)
                  for _ in range(cfg.num_layers)]
    seqs = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in (22, 13, 9)]
    schedules = [[7, 1, 5, 1, 1, 6, 1], [1, 4, 1, 1, 6], [9]]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    per_seq = -(-22 // block_size)
    tables = [perm[i * per_seq : (i + 1) * per_seq] for i in range(3)]
    want, want_caches = _run_schedule(model, False, caches, seqs, schedules, tables, block_size)
    got, got_caches = _run_schedule(model, True, caches, seqs, schedules, tables, block_size)
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape and torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item()}"
    for layer, (a, b) in enumerate(zip(got_caches, want_caches, strict=True)):
        assert a.dtype == b.dtype == (kv_dtype if turbo is None else torch.uint8)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"layer {layer} cache differs"


@pytest.mark.parametrize(
    ("case", "qtypes", "neox"),
    [
        ("llama", {}, True),  # F32 blocks, GQA 4/2
        ("llama", {}, False),  # gptj (adjacent-pair) RoPE
        ("qwen2_bias", {"q_proj": QT.Q8_0, "k_proj": QT.Q8_0, "v_proj": QT.Q4_0, "down_proj": QT.Q4_1}, True),
        ("qwen3_qk_norm", {"q_proj": QT.Q5_0, "k_proj": QT.Q5_0, "v_proj": QT.Q5_0, "gate_proj": QT.Q8_0,
                           "up_proj": QT.Q8_0}, True),
        ("mistral_sliding", {"o_proj": QT.Q4_0}, True),
        ("yi", {"gate_proj": QT.Q5_1, "up_proj": QT.Q4_0}, False),  # one kv head; gate and up in two types
    ],
)
def test_fused_stack_bitwise_equals_op_by_op(
    case: str, qtypes: dict[str, QT], neox: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, _ = _gguf_model(case, tmp_path, qtypes)
    model.model.layers[0].self_attn.rotary.is_neox = neox  # one table object serves every layer
    fused = _count_fused_steps(monkeypatch)
    _assert_fused_equals_unfused(model, num_blocks=24, block_size=4, seed=3)
    # q/k norm: a lone token only (op by op, bigger batches norm strided views with the torch reference)
    assert fused == ([1] if case == "qwen3_qk_norm" else [17, 5, 6, 2, 7, 6, 1])


@pytest.mark.parametrize("cache", ["fp8", "turbo8", "turbo4", "turbo3"])
@pytest.mark.parametrize(("case", "qtypes"), [("llama", {}), ("qwen2_bias", {"q_proj": QT.Q8_0, "v_proj": QT.Q4_0})])
def test_fused_stack_with_a_compressed_cache_equals_op_by_op(
    cache: str, case: str, qtypes: dict[str, QT], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kvcache-dtype fp8 / turbo8 / turbo4 / turbo3 on the CPU: the fused stack stores k/v itself (e4m3 with its
    own rounding; TurboQuant rows with its own rotation, absmax and packing) and the op-by-op path through torch
    (float8 cast, ``kv_cache/turbo.py``); caches byte for byte and hidden states bitwise equal, both attending
    through the native kernel."""
    model, _ = _gguf_model(case, tmp_path, qtypes)
    fused = _count_fused_steps(monkeypatch)
    if cache == "fp8":
        _assert_fused_equals_unfused(model, num_blocks=24, block_size=4, seed=5, kv_dtype=torch.float8_e4m3fn)
    else:
        _assert_fused_equals_unfused(model, num_blocks=24, block_size=4, seed=5, turbo=cache)
    assert fused == [17, 5, 6, 2, 7, 6, 1]


def test_fused_stack_with_f32_blocks_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """F32 blocks hold the checkpoint exactly, so the fused path's logits must equal transformers' (fp32 tolerance),
    decoding one token at a time through the paged cache after a prefill."""
    model, hf = _gguf_model("qwen3_qk_norm", tmp_path, {}, seed=4)
    fused = _count_fused_steps(monkeypatch)
    g = torch.Generator().manual_seed(5)
    seq = torch.randint(0, 256, (15,), generator=g)
    want = hf_logits(hf, seq)
    cfg, block_size = model.config, 4
    model.kv_caches = [torch.randn(2, 8, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g)
                       for _ in range(cfg.num_layers)]
    table = [5, 2, 7, 0]
    got = []
    with torch.inference_mode():
        meta = AttentionMetadata.build([10], [10], "cpu", [table], block_size)
        got.append(model.compute_logits(model(seq[:10], torch.arange(10), meta)))
        for p in range(10, 15):
            meta = AttentionMetadata.build([1], [p + 1], "cpu", [table], block_size)
            got.append(model.compute_logits(model(seq[p : p + 1], torch.tensor([p]), meta)))
    assert fused == [1] * 5
    assert want.std() > 0.5
    assert (torch.cat(got) - want).abs().max().item() <= 1e-4


def test_dense_weights_keep_the_op_by_op_path(tmp_path: Path) -> None:
    """torch-dense projections (F.linear) cannot be reproduced bit for bit natively: no stack is built."""
    path = save_hf_model(make_hf_model("llama"), tmp_path)
    model = cast(LlamaForCausalLM, load_model(resolve_model_source(str(path)), torch.float32, CPU).model)
    assert model.cpu_decoder_stack() is None


@pytest.mark.slow
def test_smollm2_gguf_fused_equals_op_by_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shipped Q4_1 SmolLM2 (Q8_0 embeddings, 30 layers, 9/3 heads) with the engine's block size."""
    model = load_model(resolve_model_source(str(default_model_path())), torch.float32, CPU).model
    assert isinstance(model, LlamaForCausalLM)
    fused = _count_fused_steps(monkeypatch)
    _assert_fused_equals_unfused(model, num_blocks=12, block_size=16, seed=6)
    assert len(fused) == 7
