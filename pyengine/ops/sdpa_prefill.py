"""Prefill attention of fresh prompts through torch's fused kernels (cuDNN or flash), pinned to one backend.

Why: the time to first token of a fresh prompt is the linears (at the cuBLAS ceiling) plus prefill attention, where
our mma.sync kernel (``ops/cuda_prefill.py``) reaches ~200 TFLOP/s on the H200 and torch's flash kernel ~270. A
sequence with no cached prefix attends only to its own new K/V, which are the step's k/v rows, so it needs no paged
cache and a dense kernel can take it; everything else (prefix hits, chunk continuations, sliding window, soft-cap,
f32, head dims a backend lacks) stays on our kernel. The K/V are written to the paged cache either way.

``CANDLE_VLLM_PREFILL`` picks the backend for those rows:

- ``native``: our flash prefill kernel for every prefill row;
- ``sdpa-cudnn``: ``F.scaled_dot_product_attention`` pinned to cuDNN (one call per sequence, GQA by the kernel when
  torch allows it, the q/k/v views passed as they are when cuDNN accepts their strides, else copied/expanded);
- ``sdpa-flash``: torch's flash kernel (SDPA's flash backend) through its variable-length entry point, every run
  of consecutive fresh sequences in one launch on the strided q/k/v views, GQA by the kernel, no copies;
- ``auto`` (default, GPUs with flash attention, sm_80+): per run of fresh sequences, cuDNN when every one of them
  has at least :data:`CUDNN_MIN_TOKENS` tokens (and cuDNN takes them), else the flash kernel. Measured on the H200
  (benches/RESULTS.md, 2026-11-30): per 4k-token layer ours 739 us, flash 562, cuDNN 286 (482 TFLOP/s); four 1k
  prompts ours 259, flash 215, cuDNN 387 (one call per sequence, each with ~0.1 ms of host set-up).

A backend is pinned, never chosen by torch: SDPA runs inside ``sdpa_kernel([that backend])`` and the flash entry
point has no fallback, so an input the backend cannot take raises instead of running the slow math backend.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPAParams, SDPBackend, sdpa_kernel

from candle_vllm.pyengine.ops.transfer import to_device

ENV = "CANDLE_VLLM_PREFILL"
BACKENDS = ("auto", "native", "sdpa-cudnn", "sdpa-flash")
CUDNN_MIN_TOKENS = 2048  # auto: sequences this long go to cuDNN, shorter runs to the flash kernel (one launch)
# Prefill attention launches per backend since the last clear (``bench_decode.py`` prints it; tests read it).
ROUTES: Counter[str] = Counter()

_PINS = {"sdpa-cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa-flash": SDPBackend.FLASH_ATTENTION}


def prefill_backend() -> str:
    """The backend ``CANDLE_VLLM_PREFILL`` asks for; read per step so it can change at run time."""
    value = os.environ.get(ENV, "").strip().lower() or "auto"
    if value not in BACKENDS:
        raise ValueError(f"{ENV}={value!r} is not supported; use one of {', '.join(BACKENDS)}")
    return value


def run_backend(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: FreshRun) -> str:
    """The torch backend that takes ``run``: ``backend`` itself, or for ``auto`` the faster one for its lengths."""
    if backend != "auto":
        return backend
    return "sdpa-cudnn" if min(run.lens) >= CUDNN_MIN_TOKENS and cudnn_supported(q, k, v, run) else "sdpa-flash"


@contextmanager
def pinned(backend: str) -> Iterator[None]:
    """Allow SDPA only ``backend``'s kernel (math disabled), so an input it refuses raises instead of running slow."""
    with sdpa_kernel([_PINS[backend]]):
        yield


@dataclass
class FreshRun:
    """Consecutive sequences ``first:last`` of a step with no cached prefix (rows ``start:end`` of the batch)."""

    first: int
    last: int
    start: int
    end: int
    lens: list[int]  # new tokens (= context) per sequence
    _cu: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def max_len(self) -> int:
        return max(self.lens)

    def cu_seqlens(self, device: torch.device) -> torch.Tensor:
        """int32 [n+1] row offsets of the run's sequences on ``device``, copied once per step (not per layer)."""
        if self._cu is None or self._cu.device != device:
            cu = [0]
            for n in self.lens:
                cu.append(cu[-1] + n)
            self._cu = to_device(torch.tensor(cu, dtype=torch.int32), device)
        return self._cu


def fresh_runs(query_start_loc: Sequence[int], seq_lens: Sequence[int]) -> list[FreshRun]:
    """Maximal runs of consecutive sequences whose whole context is this step's own tokens, more than one each
    (a one-token prompt is left to the decode kernel)."""
    runs: list[FreshRun] = []
    for s, ctx in enumerate(seq_lens):
        start, end = query_start_loc[s], query_start_loc[s + 1]
        if not (end - start == ctx > 1):
            continue
        if runs and runs[-1].last == s:
            run = runs[-1]
            run.last, run.end = s + 1, end
            run.lens.append(ctx)
        else:
            runs.append(FreshRun(s, s + 1, start, end, [ctx]))
    return runs


def sdpa_eligible(
    backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sliding_window: int | None,
    softcap: float | None,
) -> bool:
    """True when ``backend`` can take fresh rows of this layer: q [T, Hq, D], k/v [T, Hk, D] of one f16/bf16 dtype
    with unit-stride heads, no sliding window, no soft-cap, D a multiple of 8 up to 256 (cuDNN's own limits are
    checked per shape by :func:`cudnn_plan`)."""
    if backend not in (*_PINS, "auto") or sliding_window is not None or softcap is not None:
        return False
    if backend == "auto" and q.is_cuda and torch.cuda.get_device_capability(q.device)[0] < 8:
        return False  # no flash kernel before sm_80
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.dtype == k.dtype == v.dtype
        and q.is_cuda
        and q.dim() == k.dim() == v.dim() == 3
        and q.shape[1] % k.shape[1] == 0
        and d % 8 == 0
        and d <= 256
        and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    )


def _heads_first(x: torch.Tensor) -> torch.Tensor:
    """[L, H, D] -> the [1, H, L, D] view SDPA takes (no copy)."""
    return x.transpose(0, 1).unsqueeze(0)


# cuDNN layouts in the order tried, cheapest first: the strided views as they are (GQA by the kernel), the
# same copied contiguous, then K/V also expanded to the query heads.
CUDNN_LAYOUTS = ("view", "contiguous", "expanded")
_cudnn_layouts: dict[tuple, str | None] = {}


def cudnn_plan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """The cheapest of :data:`CUDNN_LAYOUTS` torch lets cuDNN run for one sequence's q [L, Hq, D], k/v [L, Hk, D]
    (causal), or None when cuDNN takes none. Checked once per geometry, then remembered."""
    views = [_heads_first(x) for x in (q, k, v)]
    key = (q.dtype, q.device, *(tuple(x.shape) for x in views), *(x.stride() for x in views))
    if key not in _cudnn_layouts:
        if len(_cudnn_layouts) >= 4096:  # one entry per prompt length seen: bounded, not a leak
            _cudnn_layouts.clear()
        _cudnn_layouts[key] = _first_cudnn_layout(*views)
    return _cudnn_layouts[key]


def _first_cudnn_layout(q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor) -> str | None:
    _, hq, length, d = q4.shape
    hk = k4.shape[1]
    for layout in CUDNN_LAYOUTS:
        if layout == "expanded" and hk == hq:
            continue
        if layout == "view":
            cand = (q4, k4, v4)
        else:  # uninitialised stand-ins: only their shapes and strides are checked
            kv_shape = (1, hq if layout == "expanded" else hk, length, d)
            cand = (torch.empty_like(q4, memory_format=torch.contiguous_format),
                    torch.empty(kv_shape, dtype=q4.dtype, device=q4.device),
                    torch.empty(kv_shape, dtype=q4.dtype, device=q4.device))
        with pinned("sdpa-cudnn"):
            if torch.backends.cuda.can_use_cudnn_attention(SDPAParams(*cand, None, 0.0, True, cand[1].shape[1] != hq),
                                                           False):
                return layout
    return None


def to_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: str
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sequence's q [L, Hq, D], k/v [L, Hk, D] as the [1, H, L, D] tensors SDPA takes in ``layout`` (one of
    :data:`CUDNN_LAYOUTS`): views, contiguous copies, or contiguous with K/V repeated to the query heads."""
    q4, k4, v4 = (_heads_first(x) for x in (q, k, v))
    if layout == "expanded":
        g = q.shape[1] // k.shape[1]
        k4, v4 = k4.repeat_interleave(g, dim=1), v4.repeat_interleave(g, dim=1)
    if layout != "view":
        q4, k4, v4 = q4.contiguous(), k4.contiguous(), v4.contiguous()
    return q4, k4, v4


def sdpa_heads_first(backend: str, q4: torch.Tensor, k4: torch.Tensor, v4: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """Causal SDPA on [1, H, L, D] inputs pinned to ``backend`` (GQA when K/V have fewer heads) -> [1, Hq, L, D]."""
    with pinned(backend):
        return F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                              enable_gqa=k4.shape[1] != q4.shape[1])


def sdpa_sequence(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  layout: str = "view") -> torch.Tensor:
    """Causal attention of one fresh sequence through SDPA pinned to ``backend``: q [L, Hq, D], k/v [L, Hk, D] ->
    [L, Hq, D] (a view of SDPA's output, contiguous when the kernel keeps q's token-major layout). The copies
    ``layout`` implies are part of the call."""
    return sdpa_heads_first(backend, *to_layout(q, k, v, layout), scale)[0].transpose(0, 1)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_len: int,
                 scale: float) -> torch.Tensor:
    """Causal attention of consecutive fresh sequences in one launch of torch's flash kernel (the one SDPA's flash
    backend runs): q [R, Hq, D], k/v [R, Hk, D] strided views, sequence i on rows cu_seqlens[i]:cu_seqlens[i+1]
    (int32 on the device) -> [R, Hq, D] contiguous. GQA and strides are handled by the kernel; nothing is copied."""
    return torch.ops.aten._flash_attention_forward(
        q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale
    )[0]


def attend_fresh(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: FreshRun,
                 scale: float) -> torch.Tensor:
    """Rows ``run.start:run.end`` of q/k/v (one run of fresh sequences) through ``backend`` -> [rows, Hq, D].

    Raises ValueError when cuDNN cannot take one of the sequences (callers check :func:`cudnn_supported` first)."""
    q, k, v = q[run.start : run.end], k[run.start : run.end], v[run.start : run.end]
    if backend == "sdpa-flash":
        return flash_varlen(q, k, v, run.cu_seqlens(q.device), run.max_len, scale)
    if backend != "sdpa-cudnn":
        raise ValueError(f"attend_fresh: backend {backend!r} is not one of {', '.join(_PINS)}")
    parts, at = [], 0
    for n in run.lens:
        rows = slice(at, at + n)
        layout = cudnn_plan(q[rows], k[rows], v[rows])
        if layout is None:
            raise ValueError(f"cuDNN attention cannot take q {tuple(q[rows].shape)} {q.dtype}; use {ENV}=native")
        parts.append(sdpa_sequence(backend, q[rows], k[rows], v[rows], scale, layout))
        at += n
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def cudnn_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, run: FreshRun) -> bool:
    """True when cuDNN takes every sequence of ``run`` in some layout."""
    at = run.start
    for n in run.lens:
        rows = slice(at, at + n)
        if cudnn_plan(q[rows], k[rows], v[rows]) is None:
            return False
        at += n
    return True
