"""Flash prefill attention (``ops/cuda_prefill.py``) against float64 attention over K/V gathered on the host, the
attention dispatcher's prefill steps against the float64 CPU reference path, and the engine's greedy output with
the kernel against the same engine on the torch reference prefill path."""

from __future__ import annotations

import importlib
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _cuda_helpers import REL_TOL, assert_greedy_equal_up_to_ties, poison_allocator, rel_error
from tokenizers import Tokenizer, models, pre_tokenizers

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention
from candle_vllm.pyengine.ops.cuda_prefill import KERNEL_CONFIGS, flash_prefill, flash_prefill_supported

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
CPU = torch.device("cpu")
# The module itself (ops/__init__ re-exports its ``attention`` function under the same name).
attention_ops = importlib.import_module("candle_vllm.pyengine.ops.attention")
attention_cuda_ops = importlib.import_module("candle_vllm.pyengine.ops.attention_cuda")



def _case(query_lens: list[int], seq_lens: list[int], hq: int, hk: int, d: int, block_size: int, dtype: torch.dtype,
          seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], AttentionMetadata]:
    """q as a strided view into a fused qkv buffer, a random cache whose blocks are scattered, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    num_blocks = sum(need) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(2, num_blocks, block_size, hk, d, generator=g).to(dtype).to(DEV)
    t = sum(query_lens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q = qkv[:, : hq * d].view(t, hq, d)
    return q, cache, tables, AttentionMetadata.build(query_lens, seq_lens, DEV, tables, block_size)


def _reference(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], query_lens: list[int],
               seq_lens: list[int], scale: float, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
    hq, hk = q.shape[1], cache.shape[3]
    qd, cd = q.double().cpu(), cache.double().cpu()
    out, start = [], 0
    for table, q_len, ctx in zip(tables, query_lens, seq_lens, strict=True):
        kv = cd[:, table].flatten(1, 2)[:, :ctx]  # [2, ctx, hk, d]
        k, v = (x.repeat_interleave(hq // hk, dim=1) for x in kv)
        s = torch.einsum("qhd,khd->hqk", qd[start : start + q_len], k) * scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qp = torch.arange(ctx - q_len, ctx).view(-1, 1)
        kp = torch.arange(ctx).view(1, -1)
        keep = kp <= qp
        if window:
            keep &= kp > qp - window
        s = s.masked_fill(~keep, float("-inf"))
        out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
        start += q_len
    return torch.cat(out)


# Odd lengths, tiles that end mid-block, cached prefixes (query shorter than its context), a one-row query.
QUERY_LENS = [37, 200, 5, 130, 1]
SEQ_LENS = [37, 455, 305, 130, 70]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(4, 4), (16, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_flash_prefill_matches_reference(dtype: torch.dtype, d: int, hq: int, hk: int, block_size: int) -> None:
    """GQA groups 1, 4 and 8, every head dim and block size, several sequences in one launch."""
    q, cache, tables, meta = _case(QUERY_LENS, SEQ_LENS, hq, hk, d, block_size, dtype, seed=d + hq + block_size)
    assert meta.block_tables is not None
    scale = d**-0.5
    poison_allocator(DEV, 1 << 22)
    got = flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(QUERY_LENS), scale)
    assert rel_error(got, _reference(q, cache, tables, QUERY_LENS, SEQ_LENS, scale)) < REL_TOL[dtype]


@pytest.mark.parametrize("config", KERNEL_CONFIGS[128])
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (50, None), (300, None), (None, 30.0),
                                            (100, 5.0)])
def test_window_softcap_and_long_prompt(config: tuple[int, int, int], window: int | None,
                                        softcap: float | None) -> None:
    """A window of one token, windows inside and across tiles, soft-capping, and a 1500-row prompt after a
    600-token prefix (many query tiles, the longest-first order), in every tiling compiled for D = 128."""
    query_lens, seq_lens = [1500, 77, 3], [2100, 77, 900]
    q, cache, tables, meta = _case(query_lens, seq_lens, 32, 8, 128, 64, torch.bfloat16, seed=sum(config))
    assert meta.block_tables is not None
    poison_allocator(DEV, 1 << 24)
    got = flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens), 0.1,
                        window, softcap, config=config)
    want = _reference(q, cache, tables, query_lens, seq_lens, 0.1, window, softcap)
    assert rel_error(got, want) < REL_TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", KERNEL_CONFIGS[64])
def test_every_tiling_of_head_dim_64(dtype: torch.dtype, config: tuple[int, int, int]) -> None:
    q, cache, tables, meta = _case(QUERY_LENS, SEQ_LENS, 16, 4, 64, 32, dtype, seed=sum(config))
    assert meta.block_tables is not None
    poison_allocator(DEV, 1 << 22)
    got = flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(QUERY_LENS), 0.125,
                        config=config)
    assert rel_error(got, _reference(q, cache, tables, QUERY_LENS, SEQ_LENS, 0.125)) < REL_TOL[dtype]


def test_skip_single_token_leaves_decode_rows_for_the_decode_kernel() -> None:
    q, cache, tables, meta = _case(QUERY_LENS, SEQ_LENS, 8, 2, 64, 16, torch.bfloat16, seed=9)
    assert meta.block_tables is not None
    out = torch.full_like(q, float("nan")).contiguous()
    flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(QUERY_LENS), 0.125,
                  skip_single_token=True, out=out)
    single = sum(QUERY_LENS) - 1  # the last sequence has one query row
    assert torch.isnan(out[single]).all()
    want = _reference(q, cache, tables, QUERY_LENS, SEQ_LENS, 0.125)
    assert rel_error(out[:single], want[:single]) < REL_TOL[torch.bfloat16]


def test_unsupported_inputs_are_refused() -> None:
    q, cache, _, meta = _case([8], [8], 4, 4, 96, 16, torch.bfloat16, seed=1)
    assert meta.block_tables is not None
    with pytest.raises(ValueError, match="D in 64/128/256"):
        flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 8, 0.1)
    q, cache, _, meta = _case([8], [8], 4, 4, 64, 16, torch.bfloat16, seed=1)
    assert meta.block_tables is not None
    with pytest.raises(ValueError, match="int32"):
        flash_prefill(q, cache, meta.block_tables.long(), meta.query_start_loc, meta.seq_lens, 8, 0.1)
    with pytest.raises(ValueError, match="not compiled"):
        flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, 8, 0.1, config=(64, 32, 64))


def _e4m3_case(query_lens: list[int], seq_lens: list[int], hq: int, hk: int, d: int, block_size: int,
               dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, list[list[int]], AttentionMetadata]:
    """``_case`` with an e4m3 cache (``--kvcache-dtype fp8``) written directly: K = 2 randn (values above 1 and
    e4m3 subnormals below 2^-6), V the same with 1 % of the entries 100x larger (large exponents up to the
    +-448 clamp), rounded by torch's conversion."""
    q, cache, tables, meta = _case(query_lens, seq_lens, hq, hk, d, block_size, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    x = torch.randn(cache.shape, generator=g) * 2
    x[1] = torch.where(torch.rand(x[1].shape, generator=g) < 0.01, x[1] * 100, x[1])
    return q, x.clamp(-448, 448).to(torch.float8_e4m3fn).to(DEV), tables, meta


def _e4m3_reference(q: torch.Tensor, cache: torch.Tensor, tables: list[list[int]], query_lens: list[int],
                    seq_lens: list[int], scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """The float64 reference over the cached values (e4m3 -> float is exact) and q rounded to f16 as the kernel
    rounds it. What remains is the kernel's own rounding: P to f16 (finer than the bf16 P of a bf16 cache) and the
    output to q's dtype, both as in the plain path, so the plain path's REL_TOL applies unchanged."""
    return _reference(q.half().float(), cache.float(), tables, query_lens, seq_lens, scale, window, softcap)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("hq,hk", [(4, 4), (16, 2)])
@pytest.mark.parametrize("block_size", [16, 32, 64])
def test_e4m3_cache_matches_reference(dtype: torch.dtype, d: int, hq: int, hk: int, block_size: int) -> None:
    """An e4m3 cache under f16/bf16 q: every head dim (D = 64 has its own K/V swizzle), GQA 1 and 8, odd lengths
    and cached prefixes (QUERY_LENS / SEQ_LENS), scattered blocks of several sizes, the default tiling."""
    q, cache, tables, meta = _e4m3_case(QUERY_LENS, SEQ_LENS, hq, hk, d, block_size, dtype, seed=d + hq + block_size)
    assert meta.block_tables is not None
    scale = d**-0.5
    poison_allocator(DEV, 1 << 22)
    got = flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(QUERY_LENS), scale)
    assert got.dtype == dtype
    want = _e4m3_reference(q, cache, tables, QUERY_LENS, SEQ_LENS, scale)
    assert rel_error(got, want) < REL_TOL[dtype]


E4M3_TILINGS = [(d, config) for d, configs in KERNEL_CONFIGS.items() for config in configs]


@pytest.mark.parametrize("d,config", E4M3_TILINGS)
@pytest.mark.parametrize("window,softcap", [(None, None), (1, None), (50, None), (300, None), (100, 5.0)])
def test_e4m3_cache_every_tiling_window_softcap(d: int, config: tuple[int, int, int], window: int | None,
                                                softcap: float | None) -> None:
    """Every tiling compiled (for both cache types) with an e4m3 cache: a 700-row chunk after a 600-token prefix
    (several query tiles), sliding windows of one token, inside and across tiles, soft-capping, GQA 4."""
    query_lens, seq_lens = [700, 77, 3], [1300, 77, 900]
    q, cache, tables, meta = _e4m3_case(query_lens, seq_lens, 8, 2, d, 32, torch.bfloat16, seed=d + sum(config))
    assert meta.block_tables is not None
    poison_allocator(DEV, 1 << 24)
    got = flash_prefill(q, cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, max(query_lens), 0.1,
                        window, softcap, config=config)
    want = _e4m3_reference(q, cache, tables, query_lens, seq_lens, 0.1, window, softcap)
    assert rel_error(got, want) < REL_TOL[torch.bfloat16]


def test_cache_of_another_dtype_is_refused() -> None:
    """The cache is q's dtype or e4m3: an f16 cache under bf16 q (or an f32 one) is refused, not reinterpreted."""
    q, cache, _, meta = _case([8], [8], 4, 4, 64, 16, torch.bfloat16, seed=1)
    assert meta.block_tables is not None
    assert flash_prefill_supported(q, cache.to(torch.float8_e4m3fn))
    for other in (torch.float16, torch.float32):
        wrong = cache.to(other)
        assert not flash_prefill_supported(q, wrong)
        with pytest.raises(ValueError, match="same dtype or float8_e4m3fn"):
            flash_prefill(q, wrong, meta.block_tables, meta.query_start_loc, meta.seq_lens, 8, 0.1)
    # q must stay f16/bf16 whatever the cache.
    assert not flash_prefill_supported(q.float(), cache.to(torch.float8_e4m3fn))


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0)])
def test_dispatcher_prefill_steps(window: int | None, softcap: float | None) -> None:
    """``ops.attention`` on CUDA (cache write, flash prefill rows, decode-kernel rows) against the float64 CPU
    reference path: a chunk after a cached prefix, decode rows, a fresh prompt over several tiles."""
    query_lens, seq_lens = [1, 300, 1, 70, 513], [40, 700, 1025, 70, 513]
    hq, hk, d, bs = 8, 2, 128, 16
    q, cache, tables, meta = _case(query_lens, seq_lens, hq, hk, d, bs, torch.bfloat16, seed=11)
    t = sum(query_lens)
    kv = torch.randn(2, t, hk, d, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    cache_ref = cache.cpu().double()
    got = attention(q, kv[0].to(DEV), kv[1].to(DEV), cache, meta, d**-0.5, hk, window, softcap)
    meta_ref = AttentionMetadata.build(query_lens, seq_lens, CPU, tables, bs)
    want = attention(q.cpu().double(), kv[0].double(), kv[1].double(), cache_ref, meta_ref, d**-0.5, hk, window, softcap)
    assert rel_error(got, want) < REL_TOL[torch.bfloat16]
    assert rel_error(cache, cache_ref) < REL_TOL[torch.bfloat16]


VOCAB = 512
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


def _model_dir(path: Path) -> Path:
    (path / "config.json").write_text(json.dumps(TINY_LLAMA))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


def test_greedy_generation_equals_reference_prefill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens through ``LLM.generate`` with the flash kernel against the same engine whose CUDA prefill
    steps take the torch reference. Prompts of 150-600 tokens, chunked in pieces of 128 (chunks attend to their
    cached prefix), a second round sharing prefixes (prefix-cache hits). The two differ by bf16 rounding, so a
    divergence is accepted only where the reference's top two tokens are within 0.02 nats (a near tie)."""
    model = str(_model_dir(tmp_path))
    common = dict(load_format="dummy", dtype="bf16", mem=64, max_num_seqs=8, seed=0, prefill_chunk_size=128)
    flash_llm, ref_llm = LLM(model=model, **common), LLM(model=model, **common)
    launches: list[int] = []
    real = attention_cuda_ops.flash_prefill

    def counted(*a: Any, **k: Any) -> Any:
        launches.append(1)
        return real(*a, **k)

    monkeypatch.setattr(attention_cuda_ops, "flash_prefill", counted)
    rng = random.Random(3)
    base = [[rng.randrange(VOCAB) for _ in range(rng.randint(150, 600))] for _ in range(4)]
    rounds = [base, [p[: len(p) // 2] + [rng.randrange(VOCAB) for _ in range(40)] for p in base]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    for prompts in rounds:
        batch = [{"prompt_token_ids": p} for p in prompts]
        got = flash_llm.generate(batch, params)
        with monkeypatch.context() as m:
            m.setattr(attention_ops, "flash_prefill_supported", lambda *a: False)
            want = ref_llm.generate(batch, params)
        assert_greedy_equal_up_to_ties(got, want, 12)
    assert launches, "the flash prefill kernel never ran"
    assert any(o.num_cached_tokens > 0 for o in got), "the second round hit no cached prefix"
