"""TurboQuant cache kernels (``native/cuda/turbo_*.cu``): the write against the CPU encoder's bytes, the decode
attention against float64 attention over the rows' decoded vectors (keys turned back by a float64 Hadamard
matrix), over head sizes, GQA ratios, block sizes, contexts of one and many pieces, a window and a soft-cap; the
blocks decoded to dense against the CPU decoder, and steps with prefill rows through ``attention`` against float64
attention (fresh prompts on torch's attention over K/V rounded to the rows' values)."""

from __future__ import annotations

import math

import pytest
import torch
from _cuda_helpers import poison_allocator, rel_error

from candle_vllm.pyengine.kv_cache import turbo
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import cuda, cuda_rotary, cuda_turbo, sdpa_prefill
from candle_vllm.pyengine.ops.attention import AttentionMetadata, attention
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm

DEV = torch.device("cuda")
pytestmark = pytest.mark.cuda
MODES = ["turbo8", "turbo4", "turbo3"]


@pytest.fixture(autouse=True)
def _needs_kernels() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")


def unrotate(k: torch.Tensor) -> torch.Tensor:
    d = k.shape[-1]
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return k.double() @ h.T / math.sqrt(d) * turbo.channel_signs(d).double()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_write_stores_the_cpu_encoders_bytes(mode: str, d: int, dtype: torch.dtype) -> None:
    """Rows at their slots equal ``turbo.encode`` of the same values on the CPU (rotated codes may differ by one
    where a value sits on a rounding tie); negative slots and unlisted rows stay untouched. k/v are views into a
    fused buffer (a token stride beyond the heads)."""
    g = torch.Generator(device="cuda").manual_seed(d)
    t, hk = 37, 3
    fmt = TurboFormat(mode, d)
    qkv = torch.randn(t, 5 * hk * d, generator=g, device=DEV).to(dtype) * 3
    qkv[:, : hk * d].view(t, hk, d)[..., [1, 7]] *= 20  # outlier key channels
    k, v = qkv[:, : hk * d].view(t, hk, d), qkv[:, 2 * hk * d : 3 * hk * d].view(t, hk, d)
    cache = torch.full((1, 12, 16, hk, fmt.row_bytes), 0xA5, dtype=torch.uint8, device=DEV)
    slots = torch.randperm(12 * 16, generator=g, device=DEV)[:t]
    slots[5] = -1
    cuda_turbo.turbo_cache_write(k, v, cache, slots, fmt)
    rows = cache.view(-1, hk, fmt.row_bytes).cpu()
    want = turbo.encode(k.float().cpu(), v.float().cpu(), fmt)
    keep = slots.cpu() >= 0
    got = rows[slots.cpu()[keep]]
    want = want[keep]
    got_k, _ = turbo.decode(got, fmt)
    want_k, _ = turbo.decode(want, fmt)
    vo = fmt.k_bytes
    assert torch.equal(got[..., vo:], want[..., vo:]), "V codes and absmax"
    if fmt.rotated:
        step = want_k.abs().amax(-1, keepdim=True) / (7.5 if mode == "turbo4" else 3.0)
        off = (got_k - want_k).abs() > 1e-6 * step
        assert torch.all((got_k - want_k).abs() <= step * 1.0001) and off.float().mean() < 0.005
    else:
        assert torch.equal(got[..., :vo], want[..., :vo]), "e4m3 K"
    untouched = torch.ones(12 * 16, dtype=torch.bool)
    untouched[slots.cpu()[keep]] = False
    assert torch.all(rows[untouched] == 0xA5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_round_trip_gives_what_the_rows_decode_to(mode: str, d: int, dtype: torch.dtype) -> None:
    """``round_trip`` writes the same rows and leaves k/v (views into a fused buffer) equal, bit for bit, to what
    ``blocks_to_dense`` decodes from those rows; a token with a negative slot keeps its values."""
    g = torch.Generator(device="cuda").manual_seed(d + 1)
    t, hk, bs = 45, 2, 16
    fmt = TurboFormat(mode, d)
    qkv = torch.randn(t, 4 * hk * d, generator=g, device=DEV).to(dtype) * 2
    k, v = qkv[:, hk * d : 2 * hk * d].view(t, hk, d), qkv[:, 3 * hk * d :].view(t, hk, d)
    slots = torch.randperm(4 * bs, generator=g, device=DEV)[:t]
    slots[9] = -1
    plain = torch.zeros(1, 4, bs, hk, fmt.row_bytes, dtype=torch.uint8, device=DEV)
    cuda_turbo.turbo_cache_write(k, v, plain, slots, fmt)
    before = qkv.clone()
    cache = torch.zeros_like(plain)
    cuda_turbo.turbo_cache_write(k, v, cache, slots, fmt, round_trip=True)
    assert torch.equal(cache, plain), "the rows do not depend on round_trip"
    dense = torch.empty(2, 4, bs, hk, d, dtype=dtype, device=DEV)
    cuda_turbo.blocks_to_dense(cache, torch.arange(4, device=DEV), fmt, dense)
    dense = dense.view(2, 4 * bs, hk, d)
    live = slots >= 0
    assert torch.equal(k[live], dense[0, slots[live]]) and torch.equal(v[live], dense[1, slots[live]])
    assert not torch.equal(k[live], before[:, hk * d : 2 * hk * d].view(t, hk, d)[live]), "k was rounded"
    assert torch.equal(qkv[9], before[9]), "the skipped token"
    assert torch.equal(qkv[:, : hk * d], before[:, : hk * d]) and torch.equal(
        qkv[:, 2 * hk * d : 3 * hk * d], before[:, 2 * hk * d : 3 * hk * d]), "only k and v change"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("d", "style", "pair_group"), [
    (128, "neox", 0), (128, "gptj", 0), (128, "neox", 8), (64, "neox", 1), (256, "neox", 8), (64, "gptj", 0),
])
@pytest.mark.parametrize("with_norm", [False, True])
def test_rope_write_equals_the_rope_kernel_then_the_write(
    mode: str, d: int, style: str, pair_group: int, with_norm: bool,
) -> None:
    """``rope_cache_write_`` against the dense RoPE + cache kernel (the same rotation and deferred norm) followed by
    the rows' write with ``round_trip``, on views into one fused buffer, q/k heads in the paired layout where
    asked, a token with a negative slot: the same rows, q, k and v bit for bit; with the norm (a CTA's reduction
    instead of a warp's, so 1/rms may differ in its last bit) q, k and v within a bf16 rounding and all but a
    few codes equal."""
    g = torch.Generator(device="cuda").manual_seed(d + pair_group + with_norm)
    t, hq, hk, bs, hidden, positions_max = 37, 6, 2, 16, 256, 300
    fmt = TurboFormat(mode, d)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g, device=DEV) * 2).to(torch.bfloat16)
    angles = torch.rand(positions_max, d // 2, generator=g, device=DEV) * 6.3
    cos_sin = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
    positions = torch.randint(0, positions_max, (t,), generator=g, device=DEV)
    slots = torch.randperm(5 * bs, generator=g, device=DEV)[:t]
    slots[4] = -1
    norm = DeferredRMSNorm(torch.randn(t, hidden, generator=g, device=DEV).to(torch.bfloat16), 1e-5) if with_norm \
        else None
    neox = style == "neox"

    def views(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = buf.split([hq * d, hk * d, hk * d], -1)
        return q.view(t, hq, d), k.view(t, hk, d), v.view(t, hk, d)

    ref = qkv.clone()
    dense = torch.zeros(2, 5, bs, hk, d, dtype=torch.bfloat16, device=DEV)
    want = torch.zeros(1, 5, bs, hk, fmt.row_bytes, dtype=torch.uint8, device=DEV)
    q, k, v = views(ref)
    cuda_rotary.rotary_embedding_cache_(q, k, v, positions, cos_sin, neox, dense, slots, pair_group, norm)
    cuda_turbo.turbo_cache_write(k, v, want, slots, fmt, round_trip=True)
    got = torch.zeros_like(want)
    out = qkv.clone()
    cuda_turbo.rope_cache_write_(*views(out), positions, cos_sin, neox, got, slots, fmt, pair_group, norm)
    assert not torch.equal(out, qkv)
    if not with_norm:
        assert torch.equal(got, want), "rows"
        assert torch.equal(out, ref), "q, k and v"
        return
    assert (got != want).float().mean() < 0.01, "rows"
    assert rel_error(out, ref) < 1e-2, "q, k and v"
    assert ((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-6).float().mean() > 0.97


def decode_case(
    mode: str, d: int, hq: int, hk: int, bs: int, lens: list[int], dtype: torch.dtype, seed: int, junk: bool = False
) -> tuple[TurboFormat, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A cache of shuffled blocks written by the kernel; q [B, Hq, D], block tables and seq_lens on the GPU. With
    ``junk`` the unwritten rows hold 0xFF bytes (NaN absmax, NaN e4m3) and unused table entries a block id far out
    of range, so a kernel reading either fails."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    fmt = TurboFormat(mode, d)
    need = [(n + bs - 1) // bs for n in lens]
    num_blocks = sum(need) + 3
    cache = torch.full((1, num_blocks, bs, hk, fmt.row_bytes), 0xFF if junk else 0, dtype=torch.uint8, device=DEV)
    perm = torch.randperm(num_blocks, generator=g, device=DEV).tolist()
    width = max(need)
    tables = torch.full((len(lens), width), 1 << 30 if junk else 0, dtype=torch.int32)
    for s, n in enumerate(need):
        tables[s, :n] = torch.tensor([perm.pop() for _ in range(n)])
        pos = torch.arange(lens[s])
        slots = (tables[s, pos // bs] * bs + pos % bs).long()
        k = (torch.randn(lens[s], hk, d, generator=g, device=DEV) * 2).to(dtype)
        v = torch.randn(lens[s], hk, d, generator=g, device=DEV).to(dtype)
        cuda_turbo.turbo_cache_write(k, v, cache, slots.to(DEV), fmt)
    q = torch.randn(len(lens), hq, d, generator=g, device=DEV).to(dtype)
    return fmt, cache, q, tables.to(DEV), torch.tensor(lens, dtype=torch.int32, device=DEV)


def decoded_context(cache: torch.Tensor, table: torch.Tensor, n: int, fmt: TurboFormat
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [n, Hk, D] (float64) of one sequence's rows, decoded on the CPU, keys turned back where rotated."""
    bs = cache.shape[2]
    pos = torch.arange(n)
    k, v = turbo.decode(cache[0].cpu()[table.cpu().long()[pos // bs], pos % bs], fmt)
    return (unrotate(k) if fmt.rotated else k.double()), v.double()


def attend64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
             softcap: float | None) -> torch.Tensor:
    """float64 causal attention of q [Lq, Hq, D], the last Lq positions of k/v [n, Hk, D]."""
    lq, hq, n, hk = q.shape[0], q.shape[1], k.shape[0], k.shape[1]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(lq):
        pos = n - lq + i
        first = max(0, pos + 1 - window) if window else 0
        for h in range(hq):
            sc = k[first : pos + 1, h // (hq // hk)] @ q[i, h].double().cpu() * scale
            if softcap:
                sc = softcap * torch.tanh(sc / softcap)
            out[i, h] = torch.softmax(sc, 0) @ v[first : pos + 1, h // (hq // hk)]
    return out


def nan_if_float(t: torch.Tensor) -> torch.Tensor:
    return t.fill_(float("nan")) if t.is_floating_point() else t


def reference(q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lens: list[int], fmt: TurboFormat,
              scale: float, window: int | None, softcap: float | None) -> torch.Tensor:
    """float64 attention of each sequence's query over its decoded rows (keys turned back where rotated)."""
    return torch.cat([
        attend64(q[s : s + 1], *decoded_context(cache, tables[s], n, fmt), scale, window, softcap)
        for s, n in enumerate(lens)
    ])


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("d", "hq", "hk", "bs", "lens"), [
    (128, 32, 8, 16, [1, 77, 256, 257, 1000]),
    (64, 9, 3, 64, [5, 300, 64]),
    (256, 8, 1, 16, [700, 2]),
    (128, 28, 4, 64, [3000, 129]),
    (64, 4, 2, 16, [40, 600]),
    (128, 4, 4, 16, [3, 300]),
    (128, 12, 1, 16, [300, 5]),  # 12 q heads a kv head: chunks of 8 and 4
    (64, 32, 2, 16, [700]),  # 16 a kv head: two chunks of 8
])
def test_decode_matches_float64_attention_over_the_rows(
    mode: str, d: int, hq: int, hk: int, bs: int, lens: list[int], tensor_cores: bool
) -> None:
    """Both kernels (the tensor-core one takes D 64 / 128 at block sizes of 16s, except 3-bit keys at D 64; the
    CUDA-core one the rest), q read in place from a view into a fused buffer (NaN around it)."""
    poison_allocator(DEV, 1 << 22)
    fmt, cache, q, tables, seq_lens = decode_case(mode, d, hq, hk, bs, lens, torch.bfloat16, d + hq, junk=True)
    assert cuda_turbo.tensor_cores_take(fmt, bs) == (d in (64, 128) and bs % 16 == 0 and (mode, d) != ("turbo3", 64))
    fused = torch.full((q.shape[0], (hq + 3) * d), float("nan"), dtype=q.dtype, device=DEV)
    fused[:, d : (hq + 1) * d] = q.flatten(1)
    got = cuda_turbo.turbo_decode_attention(fused[:, d : (hq + 1) * d].view(-1, hq, d), cache, tables, seq_lens,
                                            d**-0.5, max(lens), fmt, tensor_cores=tensor_cores)
    want = reference(q, cache, tables, lens, fmt, d**-0.5, None, None)
    assert rel_error(got, want) < 1e-2


@pytest.mark.parametrize("tensor_cores", [True, False])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("d", "hq", "hk"), [(128, 16, 4), (64, 2, 2)])
@pytest.mark.parametrize(("window", "softcap", "grid_len"),
                         [(100, None, 2048), (None, 30.0, 600), (40, 20.0, 4096), (300, None, 4096)])
@pytest.mark.parametrize("pieces", [None, 1, 3])
def test_decode_window_softcap_and_a_graph_sized_grid(
    mode: str, d: int, hq: int, hk: int, window: int | None, softcap: float | None, grid_len: int, tensor_cores: bool,
    pieces: int | None, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sliding window (its start off a 16-token tile), a soft-cap, and pieces for a longer context than any
    sequence (a CUDA graph's grid): the idle pieces write no partials (they start as NaN here) and the reduction
    reads none. Also one piece per sequence and three (spans cut at 256-token multiples; window 300 puts a piece
    boundary inside a 16-token tile). f16 activations."""
    lens = [1, 130, 555]
    fmt, cache, q, tables, seq_lens = decode_case(mode, d, hq, hk, 16, lens, torch.float16, 7, junk=True)
    empty = torch.empty
    with monkeypatch.context() as m:  # the partials start as NaN
        m.setattr(torch, "empty", lambda *a, **kw: nan_if_float(empty(*a, **kw)))
        got = cuda_turbo.turbo_decode_attention(q, cache, tables, seq_lens, 0.1, grid_len, fmt, window, softcap,
                                                tensor_cores, pieces)
    want = reference(q, cache, tables, lens, fmt, 0.1, window, softcap)
    assert rel_error(got, want) < 5e-3


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blocks_to_dense_equal_the_cpu_decoder(mode: str, d: int, dtype: torch.dtype) -> None:
    """Written blocks, listed shuffled and one twice, decoded to dense blocks: the CPU decoder's values (keys turned
    back by a float64 Hadamard matrix) rounded once to the output dtype."""
    poison_allocator(DEV, 1 << 22)
    fmt, cache, _, tables, _ = decode_case(mode, d, 4, 2, 16, [16 * 9], dtype, d)
    blocks = tables[0, [7, 2, 2, 0, 8, 5]].long()
    got = torch.empty(2, 6, 16, 2, d, dtype=dtype, device=DEV)
    cuda_turbo.blocks_to_dense(cache, blocks, fmt, got)
    k, v = turbo.decode(cache[0].cpu()[blocks.cpu()], fmt)
    want = torch.stack((unrotate(k) if fmt.rotated else k.double(), v.double()))
    ulp = 2**-8 if dtype == torch.bfloat16 else 2**-11
    assert torch.all((got.double().cpu() - want).abs() <= want.abs() * ulp + 1e-5 * want.abs().max())
    assert want.abs().amin(-1).gt(0).float().mean() > 0.5, "most vectors hold non-zero values"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("d", "hq", "hk", "window", "softcap", "dtype"), [
    (128, 32, 8, None, None, torch.bfloat16),
    (64, 12, 1, 50, None, torch.float16),  # a window: only the blocks it reaches are decoded
    (256, 8, 2, None, 30.0, torch.bfloat16),
])
def test_steps_with_prefill_rows_match_float64_attention(
    mode: str, d: int, hq: int, hk: int, window: int | None, softcap: float | None, dtype: torch.dtype,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step of fresh prompts, chunks over cached prefixes, one-token rows and a sequence with no new token
    through ``attention`` on a turbo cache: the flash kernel over the decoded blocks and the decode kernel, never
    the torch reference, against float64 attention over the CPU decoder's vectors."""
    monkeypatch.setattr(turbo, "read_blocks", lambda *a: pytest.fail("the torch reference read the rows"))
    monkeypatch.setenv(sdpa_prefill.ENV, "native")  # kv_new are no rows' values: fresh prompts on the flash kernel
    poison_allocator(DEV, 1 << 24)
    cached_new = [(0, 300), (130, 1), (517, 64), (40, 1), (33, 0), (0, 17), (15, 2)]
    lens = [c + n for c, n in cached_new]
    fmt, cache, _, tables, _ = decode_case(mode, d, hq, hk, 16, lens, dtype, d + hq)
    g = torch.Generator(device="cuda").manual_seed(3)
    t = sum(n for _, n in cached_new)
    q = torch.randn(t, hq, d, generator=g, device=DEV).to(dtype)
    kv_new = torch.zeros(t, hk, d, dtype=dtype, device=DEV)  # already in the cache (kv_cached)
    meta = AttentionMetadata.build([n for _, n in cached_new], lens, DEV, tables.tolist(), 16)
    got = attention(q, kv_new, kv_new, cache, meta, d**-0.5, hk, window, softcap, kv_cached=True)
    start = 0
    for s, (_, n) in enumerate(cached_new):
        if n == 0:
            continue
        want = attend64(q[start : start + n], *decoded_context(cache, tables[s], lens[s], fmt), d**-0.5, window,
                        softcap)
        assert rel_error(got[start : start + n], want) < 1e-2, f"sequence {s}"
        start += n


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backend", ["auto", "sdpa-flash", "sdpa-cudnn"])
@pytest.mark.parametrize("cached_new", [
    [(0, 300), (0, 17), (130, 1), (517, 64), (0, 40), (40, 1), (33, 0)],
    [(0, 1000)],  # only a fresh prompt: the TTFT step
], ids=["mixed", "fresh"])
def test_fresh_prompts_attend_to_what_the_cache_holds(
    mode: str, backend: str, cached_new: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A step that writes its K/V: fresh prompts take torch's attention over the step's own K/V rounded to the
    cache's values, a chunk over a cached prefix our flash kernel, one-token rows the decode kernel; each against
    float64 attention over the CPU decoder's vectors of the rows as written."""
    monkeypatch.setattr(turbo, "read_blocks", lambda *a: pytest.fail("the torch reference read the rows"))
    monkeypatch.setenv(sdpa_prefill.ENV, backend)
    d, hq, hk, bs, dtype = 128, 16, 4, 16, torch.bfloat16
    lens = [c + n for c, n in cached_new]
    fmt, cache, _, tables, _ = decode_case(mode, d, hq, hk, bs, [c or 1 for c, _ in cached_new], dtype, 7)
    width = max((n + bs - 1) // bs for n in lens)
    free = iter(range(cache.shape[1], cache.shape[1] + 1000))
    grown = torch.zeros(len(lens), width, dtype=torch.int32)
    for s, (c, _) in enumerate(cached_new):  # prefix blocks as written, then fresh blocks for the new tokens
        have = (c + bs - 1) // bs
        grown[s, :have] = tables[s, :have].cpu()
        need = (lens[s] + bs - 1) // bs
        grown[s, have:need] = torch.tensor([next(free) for _ in range(have, need)], dtype=torch.int32)
    extra = int(grown.max()) + 1 - cache.shape[1]
    cache = torch.cat([cache, torch.zeros(1, extra, *cache.shape[2:], dtype=cache.dtype, device=DEV)], 1)
    g = torch.Generator(device="cuda").manual_seed(11)
    t = sum(n for _, n in cached_new)
    q = torch.randn(t, hq, d, generator=g, device=DEV).to(dtype)
    kv = (torch.randn(t, 2, hk, d, generator=g, device=DEV) * 2).to(dtype)
    k, v = kv[:, 0], kv[:, 1]
    meta = AttentionMetadata.build([n for _, n in cached_new], lens, DEV, grown.tolist(), bs)
    sdpa_prefill.ROUTES.clear()
    got = attention(q, k, v, cache, meta, d**-0.5, hk, None, None)
    torch_route = "sdpa-flash" if backend == "auto" else backend  # auto: every prompt here is under CUDNN_MIN_TOKENS
    runs = len(meta.fresh_runs)
    assert dict(sdpa_prefill.ROUTES) == ({torch_route: runs, "native": 1} if len(lens) > 1 else {torch_route: 1})
    start = 0
    for s, (_, n) in enumerate(cached_new):
        if n == 0:
            continue
        want = attend64(q[start : start + n], *decoded_context(cache, grown[s].to(DEV), lens[s], fmt), d**-0.5,
                        None, None)
        assert rel_error(got[start : start + n], want) < 1e-2, f"sequence {s}"
        start += n
