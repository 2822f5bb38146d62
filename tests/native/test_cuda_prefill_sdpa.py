"""The fresh-prompt prefill route through torch's cuDNN / flash kernels (``ops/sdpa_prefill.py``, selected by
``CANDLE_VLLM_PREFILL``): the attention dispatcher's steps against the float64 CPU reference path (fresh prompts,
a prefix hit and a decode row in one step, so both routes run), the backend pin (a refused input raises instead of
running the math backend; the profiler shows the pinned kernel), and greedy generation against the engine on our
kernel."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _cuda_helpers import REL_TOL, assert_greedy_equal_up_to_ties, poison_allocator, rel_error
from test_cuda_flash_prefill import _model_dir
from torch.profiler import ProfilerActivity, profile

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.ops import sdpa_prefill
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention

pytestmark = pytest.mark.cuda
DEV = torch.device("cuda")
CPU = torch.device("cpu")
SDPA_BACKENDS = ("sdpa-cudnn", "sdpa-flash")



def _step(query_lens: list[int], seq_lens: list[int], hq: int, hk: int, d: int, block_size: int,
          dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """q/k/v as views into one fused qkv buffer (as the engine passes them) and a random cache with scattered
    blocks (the cached prefixes)."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    perm = torch.randperm(sum(need) + 2, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    cache = torch.randn(2, len(perm), block_size, hk, d, generator=g).to(dtype).to(DEV)
    t = sum(query_lens)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(dtype).to(DEV)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([hq * d, hk * d, hk * d], dim=-1))
    return q, k, v, cache, tables


def _run_against_reference(monkeypatch: pytest.MonkeyPatch, backend: str, query_lens: list[int],
                           seq_lens: list[int], hq: int, hk: int, d: int, dtype: torch.dtype,
                           window: int | None = None, softcap: float | None = None) -> None:
    """The CUDA dispatcher under ``backend`` against ``ops.attention`` on the host in float64 (outputs and the
    cache written by the step)."""
    bs = 16
    q, k, v, cache, tables = _step(query_lens, seq_lens, hq, hk, d, bs, dtype, seed=hq * d + len(query_lens))
    scale = d**-0.5
    cache_ref = cache.cpu().double()
    want = attention(q.cpu().double(), k.cpu().double(), v.cpu().double(), cache_ref,
                     AttentionMetadata.build(query_lens, seq_lens, CPU, tables, bs), scale, hk, window, softcap)
    monkeypatch.setenv(sdpa_prefill.ENV, backend)
    poison_allocator(DEV, 1 << 24)
    got = attention(q, k, v, cache, AttentionMetadata.build(query_lens, seq_lens, DEV, tables, bs), scale, hk,
                    window, softcap)
    assert got.shape == q.shape
    assert rel_error(got, want) < REL_TOL[dtype]
    assert rel_error(cache, cache_ref) < REL_TOL[dtype]


# Fresh prompts of odd lengths in two runs, a prefix hit (130 new rows after 175 cached) and a decode row between them.
MIXED_QUERY = [37, 200, 130, 1, 301, 5]
MIXED_SEQ = [37, 200, 305, 70, 301, 5]


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hk,d", [(16, 4, 128), (8, 8, 128), (16, 4, 64), (8, 8, 64)])
def test_mixed_step_matches_reference(monkeypatch: pytest.MonkeyPatch, backend: str, dtype: torch.dtype, hq: int,
                                      hk: int, d: int) -> None:
    """GQA 4:1 and 1:1, D 64/128: both fresh runs take the torch backend, the prefix hit our kernel."""
    sdpa_prefill.ROUTES.clear()
    _run_against_reference(monkeypatch, backend, MIXED_QUERY, MIXED_SEQ, hq, hk, d, dtype)
    assert dict(sdpa_prefill.ROUTES) == {backend: 2, "native": 1}


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_ttft_step_matches_reference(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """One fresh 999-token prompt with Llama-3 heads (32/8, D=128): the whole step in one backend call."""
    sdpa_prefill.ROUTES.clear()
    _run_against_reference(monkeypatch, backend, [999], [999], 32, 8, 128, torch.bfloat16)
    assert dict(sdpa_prefill.ROUTES) == {backend: 1}


def test_auto_sends_long_prompts_to_cudnn_and_short_runs_to_flash(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: a fresh prompt of >= CUDNN_MIN_TOKENS tokens takes cuDNN, a shorter fresh one flash, a prefix hit ours."""
    long = sdpa_prefill.CUDNN_MIN_TOKENS + 37
    sdpa_prefill.ROUTES.clear()
    _run_against_reference(monkeypatch, "auto", [long, 30, 301], [long, 95, 301], 32, 8, 128, torch.bfloat16)
    assert dict(sdpa_prefill.ROUTES) == {"sdpa-cudnn": 1, "sdpa-flash": 1, "native": 1}


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
@pytest.mark.parametrize("window,softcap", [(64, None), (None, 30.0)])
def test_window_and_softcap_stay_on_our_kernel(monkeypatch: pytest.MonkeyPatch, backend: str, window: int | None,
                                               softcap: float | None) -> None:
    sdpa_prefill.ROUTES.clear()
    _run_against_reference(monkeypatch, backend, MIXED_QUERY, MIXED_SEQ, 8, 2, 128, torch.bfloat16, window, softcap)
    assert dict(sdpa_prefill.ROUTES) == {"native": 1}


@pytest.mark.parametrize("backend", SDPA_BACKENDS)
def test_pin_refuses_instead_of_falling_back(backend: str) -> None:
    """f32 is outside both kernels: unpinned SDPA runs it (on the math backend), pinned it raises."""
    q = torch.randn(1, 4, 64, 64, device=DEV)
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
    with pytest.raises(RuntimeError), sdpa_prefill.pinned(backend):
        F.scaled_dot_product_attention(q, q, q, is_causal=True)


@pytest.mark.parametrize("backend,op", [("sdpa-cudnn", "aten::_scaled_dot_product_cudnn_attention"),
                                        ("sdpa-flash", "aten::_flash_attention_forward")])
def test_route_runs_the_pinned_kernel(monkeypatch: pytest.MonkeyPatch, backend: str, op: str) -> None:
    """The profiler sees the chosen kernel's op and neither the math nor the memory-efficient backend."""
    query_lens = [300, 77]
    q, k, v, cache, tables = _step(query_lens, query_lens, 32, 8, 128, 16, torch.bfloat16, seed=5)
    meta = AttentionMetadata.build(query_lens, query_lens, DEV, tables, 16)
    monkeypatch.setenv(sdpa_prefill.ENV, backend)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attention(q, k, v, cache, meta, 128**-0.5, 8)
    names = {e.key for e in prof.key_averages()}
    assert op in names, sorted(names)
    assert not names & {"aten::_scaled_dot_product_attention_math", "aten::_scaled_dot_product_efficient_attention"}


def test_greedy_generation_equals_native_prefill(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy tokens through ``LLM.generate`` with each torch backend against the engine on our kernel: fresh
    prompts of 150-400 tokens, then a round sharing their prefixes (prefix hits on our kernel beside fresh rows).
    Divergence is accepted only at a near tie of the native run's top two tokens (0.02 nats), as bf16 allows."""
    model = str(_model_dir(tmp_path))
    common = dict(load_format="dummy", dtype="bf16", mem=64, max_num_seqs=8, seed=0)
    rng = random.Random(4)
    base = [[rng.randrange(512) for _ in range(rng.randint(150, 400))] for _ in range(3)]
    rounds = [base, [p[: len(p) // 2] + [rng.randrange(512) for _ in range(30)] for p in base]
              + [[rng.randrange(512) for _ in range(211)]]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    runs: dict[str, list] = {}
    for backend in ("native", *SDPA_BACKENDS):
        monkeypatch.setenv(sdpa_prefill.ENV, backend)
        sdpa_prefill.ROUTES.clear()
        llm = LLM(model=model, **common)
        runs[backend] = [llm.generate([{"prompt_token_ids": p} for p in prompts], params) for prompts in rounds]
        assert backend == "native" or sdpa_prefill.ROUTES[backend] > 0, dict(sdpa_prefill.ROUTES)
        del llm
    for backend in SDPA_BACKENDS:
        for got_round, want_round in zip(runs[backend], runs["native"], strict=True):
            assert_greedy_equal_up_to_ties(got_round, want_round, 8, backend)
    assert any(o.num_cached_tokens > 0 for o in runs["sdpa-flash"][1]), "the second round hit no cached prefix"
