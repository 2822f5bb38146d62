"""Flat-batch attention (no cache and paged) against a naive per-sequence, per-head loop."""

from __future__ import annotations

import math

import pytest
import torch

from candle_vllm.pyengine.kv_cache import turbo
from candle_vllm.pyengine.kv_cache.cache_tensors import allocate_kv_caches
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention, write_kv

HQ, HK, D = 8, 2, 16


def naive(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, softcap: float | None
) -> torch.Tensor:
    """One sequence: q [Lq, HQ, D] are the last Lq of the Lk positions of k/v [Lk, HK, D]."""
    lq, lk = q.shape[0], k.shape[0]
    out = torch.zeros_like(q)
    for h in range(HQ):
        kh, vh = k[:, h // (HQ // HK)], v[:, h // (HQ // HK)]
        for i in range(lq):
            pos = lk - lq + i
            s = (kh[: pos + 1] @ q[i, h]) / math.sqrt(D)
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if window is not None:
                s[: max(0, pos + 1 - window)] = float("-inf")
            out[i, h] = torch.softmax(s, 0) @ vh[: pos + 1]
    return out


@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 5.0)])
def test_no_cache_is_causal_within_each_sequence(window: int | None, softcap: float | None) -> None:
    g = torch.Generator().manual_seed(1)
    lens = [5, 1, 9]
    t = sum(lens)
    q, k, v = (torch.randn(t, h, D, generator=g) for h in (HQ, HK, HK))
    got = attention(q, k, v, None, AttentionMetadata.build(lens), D**-0.5, HK, window, softcap)
    start = 0
    for n in lens:
        sl = slice(start, start + n)
        torch.testing.assert_close(got[sl], naive(q[sl], k[sl], v[sl], window, softcap), atol=1e-5, rtol=1e-5)
        start += n


def _prefix_then_step(
    cache: torch.Tensor, tables: list[list[int]], bs: int, cached_new: list[tuple[int, int]],
    full_k: list[torch.Tensor], full_v: list[torch.Tensor], g: torch.Generator, window: int | None,
    softcap: float | None,
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Each sequence's cached prefix written through ``write_kv``, then one step of its new tokens (random
    queries of K's dtype, bf16 values, on the cache's device): the queries per sequence, the output, the new keys and the step's
    metadata."""
    dev = cache.device
    pre = AttentionMetadata.build([c for c, _ in cached_new], [c for c, _ in cached_new], dev, tables, bs)
    assert pre.slot_mapping is not None
    write_kv(torch.cat([fk[:c] for fk, (c, _) in zip(full_k, cached_new, strict=True)]),
             torch.cat([fv[:c] for fv, (c, _) in zip(full_v, cached_new, strict=True)]), cache, pre.slot_mapping)
    meta = AttentionMetadata.build([n for _, n in cached_new], [c + n for c, n in cached_new], dev, tables, bs)
    qs = [torch.randn(n, HQ, D, generator=g).bfloat16().to(dev, full_k[0].dtype) for _, n in cached_new]
    k_new = torch.cat([fk[c:] for fk, (c, _) in zip(full_k, cached_new, strict=True)])
    v_new = torch.cat([fv[c:] for fv, (c, _) in zip(full_v, cached_new, strict=True)])
    return qs, attention(torch.cat(qs), k_new, v_new, cache, meta, D**-0.5, HK, window, softcap), k_new, meta


def _use(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Run attention through the native CPU kernel, or the torch reference (forced with CANDLE_VLLM_OPS)."""
    if impl == "reference":
        monkeypatch.setenv("CANDLE_VLLM_OPS", "reference")
    elif native.module() is None:
        pytest.fail("candle_vllm._native is not built")


def _shuffled_tables(cached_new: list[tuple[int, int]], bs: int, num_blocks: int,
                     g: torch.Generator) -> list[list[int]]:
    """Block tables covering each sequence's cached + new tokens, with shuffled block ids."""
    perm = torch.randperm(num_blocks, generator=g).tolist()
    return [[perm.pop() for _ in range((c + n + bs - 1) // bs)] for c, n in cached_new]


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 4.0)])
def test_paged_mixed_prefill_and_decode(
    impl: str, dtype: torch.dtype, tol: float, window: int | None, softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sequences with (cached, new) tokens across block boundaries, GQA, shuffled block ids; both the
    native CPU kernel and the torch reference (forced with CANDLE_VLLM_OPS=reference)."""
    _use(impl, monkeypatch)
    g = torch.Generator().manual_seed(2)
    bs, num_blocks = 4, 24
    cached_new = [(0, 7), (5, 1), (8, 1), (3, 6), (13, 1), (4, 4)]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, full_k, full_v = [], [], []
    cache = torch.randn(2, num_blocks, bs, HK, D, generator=g).to(dtype)  # garbage outside written slots
    for c, n in cached_new:
        need = (c + n + bs - 1) // bs
        tables.append([perm.pop() for _ in range(need)])
        full_k.append(torch.randn(c + n, HK, D, generator=g).to(dtype))
        full_v.append(torch.randn(c + n, HK, D, generator=g).to(dtype))
    # fill the cached prefix of each sequence through the public write path
    qs, got, k_new, meta = _prefix_then_step(cache, tables, bs, cached_new, full_k, full_v, g, window, softcap)
    start = 0
    for q, fk, fv, (_, n) in zip(qs, full_k, full_v, cached_new, strict=True):
        want = naive(q.float(), fk.float(), fv.float(), window, softcap)
        torch.testing.assert_close(got[start : start + n].float(), want, atol=tol, rtol=tol)
        start += n
    # the new keys landed in the cache at their slots
    assert meta.slot_mapping is not None
    torch.testing.assert_close(cache[0].view(-1, HK, D)[meta.slot_mapping], k_new)


def test_build_rejects_query_longer_than_sequence() -> None:
    with pytest.raises(ValueError, match="query length"):
        AttentionMetadata.build([5], [3])


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """What an e4m3 cache holds for x, in f32: the format's largest finite value is 448 (saturated there), and
    torch's own float8 cast is the rounding oracle."""
    return x.float().clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()


# f32: values reach 448, so summation order alone moves the output by a few 1e-5
@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 4.0)])
def test_e4m3_cache_attends_to_the_stored_values(
    impl: str, dtype: torch.dtype, tol: float, window: int | None, softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--kvcache-dtype fp8 on the CPU: cached prefixes and new tokens written as e4m3 (some past 448, so the
    saturation shows), attention equal to the naive loop over the e4m3-rounded keys and values, through the
    native CPU kernel's e4m3 loads and the torch reference."""
    _use(impl, monkeypatch)
    g = torch.Generator().manual_seed(3)
    bs, num_blocks = 4, 16
    cached_new = [(0, 6), (5, 1), (9, 3), (2, 1)]
    cache = torch.zeros(2, num_blocks, bs, HK, D, dtype=torch.float8_e4m3fn)
    tables = _shuffled_tables(cached_new, bs, num_blocks, g)

    def kv(n: int) -> torch.Tensor:
        x = torch.randn(n, HK, D, generator=g) * 3
        x[torch.rand(n, HK, D, generator=g) < 0.05] *= 400  # a few values beyond e4m3's range
        return x.to(dtype)

    full_k = [kv(c + n) for c, n in cached_new]
    full_v = [kv(c + n) for c, n in cached_new]
    qs, got, k_new, meta = _prefix_then_step(cache, tables, bs, cached_new, full_k, full_v, g, window, softcap)
    start = 0
    for q, fk, fv, (_, n) in zip(qs, full_k, full_v, cached_new, strict=True):
        want = naive(q.float(), e4m3(fk), e4m3(fv), window, softcap)
        # bf16 rounds the probabilities; with values up to 448 the error scales with the output's magnitude
        torch.testing.assert_close(got[start : start + n].float(), want, atol=tol * want.abs().max().item(), rtol=tol)
        start += n
    assert meta.slot_mapping is not None
    stored = cache[0].view(-1, HK, D)[meta.slot_mapping].float()
    torch.testing.assert_close(stored, e4m3(k_new), atol=0, rtol=0)
    assert stored.abs().max() == 448.0  # saturated, not NaN


def unrotate(k: torch.Tensor) -> torch.Tensor:
    """The inverse of TurboQuant's key rotation, s * (H k) / sqrt(D), by a float64 Hadamard matrix."""
    d = k.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return (k.double() @ h.T / math.sqrt(d) * turbo.channel_signs(d).double()).float()


@pytest.mark.parametrize("impl", ["native", "reference"])
@pytest.mark.parametrize("mode", ["turbo8", "turbo4", "turbo3"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("window,softcap", [(None, None), (6, None), (None, 4.0)])
def test_turbo_cache_attends_to_the_decoded_rows(
    impl: str, mode: str, dtype: torch.dtype, tol: float, window: int | None, softcap: float | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """--kvcache-dtype turbo8/4/3 on the CPU: attention equal to the naive loop over the rows' decoded keys (turned
    back by a float64 Hadamard matrix where they were rotated) and values, through the native CPU kernel (which
    rotates each query and decodes the rows itself) and the torch reference."""
    _use(impl, monkeypatch)
    g = torch.Generator().manual_seed(4)
    bs, num_blocks = 4, 16
    cached_new = [(0, 6), (5, 1), (9, 3), (2, 1)]
    fmt = TurboFormat(mode, D)
    cache = allocate_kv_caches(1, num_blocks, bs, HK, D, dtype, torch.device("cpu"), fmt)[0]
    tables = _shuffled_tables(cached_new, bs, num_blocks, g)
    full_k = [(torch.randn(c + n, HK, D, generator=g) * 2).to(dtype) for c, n in cached_new]
    full_v = [torch.randn(c + n, HK, D, generator=g).to(dtype) for c, n in cached_new]
    qs, got, _, _ = _prefix_then_step(cache, tables, bs, cached_new, full_k, full_v, g, window, softcap)
    start = 0
    for q, fk, fv, (_, n) in zip(qs, full_k, full_v, cached_new, strict=True):
        k_read, v_read = turbo.decode(turbo.encode(fk, fv, fmt), fmt)
        want = naive(q.float(), unrotate(k_read) if fmt.rotated else k_read, v_read, window, softcap)
        torch.testing.assert_close(got[start : start + n].float(), want, atol=tol, rtol=tol)
        start += n


@pytest.mark.cuda
@pytest.mark.parametrize("mode", ["turbo8", "turbo4", "turbo3"])
def test_turbo_cache_on_cuda_reads_what_the_cpu_kernel_reads(mode: str) -> None:
    """On CUDA a TurboQuant cache is written by its kernel and, in a step with prefill rows, read through the torch
    reference: the same inputs give the CPU kernel's attention (bf16 on the GPU against f32 on the CPU), and the
    rows written there decode to within a code step of the CPU encoder's (a rounding tie may fall the other way)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bs, num_blocks = 4, 16
    cached_new = [(0, 6), (5, 1), (9, 3), (2, 1)]
    fmt = TurboFormat(mode, D)
    outs, caches = [], []
    for dev, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        g = torch.Generator().manual_seed(5)
        cache = allocate_kv_caches(1, num_blocks, bs, HK, D, dtype, torch.device(dev), fmt)[0]
        tables = _shuffled_tables(cached_new, bs, num_blocks, g)
        # the same values on both devices (bf16's): a quantizer's codes would turn f32-vs-bf16 noise into steps
        full_k = [(torch.randn(c + n, HK, D, generator=g) * 2).bfloat16().to(dev, dtype) for c, n in cached_new]
        full_v = [torch.randn(c + n, HK, D, generator=g).bfloat16().to(dev, dtype) for c, n in cached_new]
        _, got, _, _ = _prefix_then_step(cache, tables, bs, cached_new, full_k, full_v, g, None, None)
        outs.append(got.float().cpu())
        caches.append(cache.cpu())
    torch.testing.assert_close(outs[1], outs[0], atol=3e-2, rtol=3e-2)
    (k_cpu, v_cpu), (k_gpu, v_gpu) = (turbo.decode(c[0], fmt) for c in caches)
    for cpu_x, gpu_x in ((k_cpu, k_gpu), (v_cpu, v_gpu)):
        step = cpu_x.abs().amax(-1, keepdim=True) / 3.0  # the coarsest code step (3 bits); bf16 inputs move a little
        assert torch.all((gpu_x - cpu_x).abs() <= step + 0.02)


@pytest.mark.parametrize("mode", ["turbo8", "turbo4", "turbo3"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_turbo_cpu_kernel_at_model_head_sizes(mode: str, d: int) -> None:
    """The native CPU kernel over TurboQuant rows at the head sizes models use (the tests above run D = 16): a
    decode step of three sequences against float64 attention over the rows' decoded vectors."""
    if native.module() is None:
        pytest.fail("candle_vllm._native is not built")
    g = torch.Generator().manual_seed(d)
    hq, hk, bs, num_blocks = 8, 2, 16, 16
    lens = [1, 40, 77]
    fmt = TurboFormat(mode, d)
    cache = allocate_kv_caches(1, num_blocks, bs, hk, d, torch.float32, torch.device("cpu"), fmt)[0]
    tables = _shuffled_tables([(n - 1, 1) for n in lens], bs, num_blocks, g)
    ks = [torch.randn(n, hk, d, generator=g) * 2 for n in lens]
    vs = [torch.randn(n, hk, d, generator=g) for n in lens]
    everything = AttentionMetadata.build(lens, lens, "cpu", tables, bs)
    assert everything.slot_mapping is not None
    write_kv(torch.cat(ks), torch.cat(vs), cache, everything.slot_mapping)
    q = torch.randn(len(lens), hq, d, generator=g)
    step = AttentionMetadata.build([1] * len(lens), lens, "cpu", tables, bs)
    last_k = torch.stack([k[-1] for k in ks])
    got = attention(q, last_k, torch.stack([v[-1] for v in vs]), cache, step, d**-0.5, hk, kv_cached=True)
    for s in range(len(lens)):
        k_read, v_read = turbo.decode(turbo.encode(ks[s], vs[s], fmt), fmt)
        k_read = unrotate(k_read) if fmt.rotated else k_read
        for h in range(hq):
            scores = k_read[:, h // (hq // hk)].double() @ q[s, h].double() * d**-0.5
            want = torch.softmax(scores, 0) @ v_read[:, h // (hq // hk)].double()
            torch.testing.assert_close(got[s, h].double(), want, atol=2e-5, rtol=2e-5)
