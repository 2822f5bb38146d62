"""A model's decoder layers as one native call per layer on CPU steps (``native/cpu/decoder_layer.h``).

Op by op, a SmolLM2 decode step is ~400 Python-dispatched ops and ~120 OpenMP fork/joins; the native stack runs
the same kernels (quantized GEMV, RMSNorm, paged attention) in the same order, a layer per parallel region, with
RoPE and the bias add rounding like the torch ops they replace. SiLU-and-mul stays torch's (``ops.activation``,
between two native calls), so the result is bitwise that of the op-by-op path. It takes f32 activations and
weights stored as GGUF blocks (any type the CPU matmul has kernels for); everything else keeps the op-by-op path
(see :meth:`CpuDecoderStack.step_supported`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from candle_vllm.pyengine.kv_cache import turbo as turbo_kv
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.ops import native
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.quant import row_bytes

# (weight address, GGMLQuantizationType value, output rows) of each part of a projection.
Parts = list[tuple[int, int, int]]


def _addr(t: torch.Tensor | None) -> int:
    return 0 if t is None else native.ptr(t)


def _cpu(t: torch.Tensor, dtype: torch.dtype) -> bool:
    return t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous()


class CpuDecoderStack:
    """The native stack plus references to every tensor it reads, so they outlive it."""

    def __init__(self) -> None:
        mod = native.module()
        if mod is None:
            raise RuntimeError("the native module is not built; the fused CPU decoder needs it")
        self._stack = mod.CpuDecoderStack()
        self._keep: list[torch.Tensor] = []
        self._kv_geometry: list[tuple[int, int]] = []  # (kv heads, head dim) per layer
        self._intermediate = 0  # every layer's (Llama-family layers share it)
        self._qk_norm = False

    def __len__(self) -> int:
        return len(self._stack)

    def add_layer(
        self,
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        scale: float,
        sliding_window: int | None,
        input_norm: torch.Tensor,
        post_norm: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        qkv: Sequence[tuple[torch.Tensor, int, int]],
        qkv_bias: torch.Tensor | None,
        o: Sequence[tuple[torch.Tensor, int, int]],
        gate_up: Sequence[tuple[torch.Tensor, int, int]],
        down: Sequence[tuple[torch.Tensor, int, int]],
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
    ) -> None:
        """Append a layer. Projections are (GGUF bytes, qtype, out rows) parts whose outputs sit side by side;
        every float tensor must be f32, contiguous and on the CPU. Raises ValueError naming what does not fit."""
        hidden = input_norm.shape[0]
        intermediate = sum(r for _, _, r in gate_up) // 2
        qkv_rows = sum(r for _, _, r in qkv)
        floats = {"input_norm": (input_norm, (hidden,)), "post_norm": (post_norm, (hidden,)),
                  "q_norm": (q_norm, (head_dim,)), "k_norm": (k_norm, (head_dim,)), "qkv_bias": (qkv_bias, (qkv_rows,)),
                  "cos_sin_cache": (cos_sin_cache, (cos_sin_cache.shape[0], cos_sin_cache.shape[-1]))}
        for name, (t, shape) in floats.items():
            if t is not None and (not _cpu(t, torch.float32) or tuple(t.shape) != shape):
                raise ValueError(f"{name}: expected a contiguous f32 CPU tensor of shape {list(shape)}")
        if self._intermediate not in (0, intermediate):
            raise ValueError("the fused CPU decoder needs one intermediate size for every layer")
        parts = [list(p) for p in (qkv, o, gate_up, down)]
        for name, ps, cols in zip(("qkv", "o", "gate_up", "down"), parts,
                                  (hidden, num_heads * head_dim, hidden, intermediate), strict=True):
            for data, qtype, rows in ps:
                if not _cpu(data, torch.uint8) or data.numel() != rows * row_bytes(QT(qtype), cols):
                    raise ValueError(f"{name}: expected contiguous uint8 CPU blocks of a [{rows}, {cols}] "
                                     f"{QT(qtype).name} matrix")
        self._stack.add_layer(  # checks the geometry (head counts, projection shapes, rotary width)
            hidden=hidden, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            intermediate=intermediate, eps=eps, scale=scale, sliding_window=sliding_window or 0,
            input_norm=_addr(input_norm), post_norm=_addr(post_norm), q_norm=_addr(q_norm), k_norm=_addr(k_norm),
            qkv=_native_parts(qkv), qkv_bias=_addr(qkv_bias), o=_native_parts(o), gate_up=_native_parts(gate_up),
            down=_native_parts(down), cos_sin=_addr(cos_sin_cache), rotary_dim=cos_sin_cache.shape[-1],
            max_positions=cos_sin_cache.shape[0], is_neox=is_neox,
        )
        self._keep += [t for t, _ in floats.values() if t is not None] + [p[0] for ps in parts for p in ps]
        self._kv_geometry.append((num_kv_heads, head_dim))
        self._intermediate = intermediate
        self._qk_norm = self._qk_norm or q_norm is not None

    def _turbo_format(self, kv_caches: Sequence[torch.Tensor]) -> TurboFormat | None:
        """The caches' TurboQuant format (layer 0 tells; step_supported checks the others), None for dense ones."""
        if not kv_caches or not self._kv_geometry:
            return None
        return TurboFormat.of_cache(kv_caches[0], self._kv_geometry[0][1])

    def step_supported(
        self, x: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence[torch.Tensor], meta: AttentionMetadata
    ) -> bool:
        """Whether this step can run natively: f32 CPU activations, one paged cache per layer (all f32, all e4m3 or
        all TurboQuant rows of one mode), and the metadata the CPU attention kernel reads (else the caller runs its
        op-by-op path). With q/k norm, one token only: op by op, the q/k views of a bigger batch are strided and take
        the torch reference norm."""
        if (
            x.device.type != "cpu"
            or (self._qk_norm and x.shape[0] != 1)
            or native.reference_forced()
            or len(kv_caches) != len(self)
            or meta.slot_mapping is None
            or meta.block_tables is None
        ):
            return False
        shape = kv_caches[0].shape
        turbo = self._turbo_format(kv_caches)
        return (
            native.ready(x, dtypes=(torch.float32,))
            and native.ready(*kv_caches, dtypes=(kv_caches[0].dtype,))
            and kv_caches[0].dtype in (torch.float32, torch.float8_e4m3fn, torch.uint8)
            and all(
                c.shape == shape
                and c.shape[3] == g[0]
                and c.shape[4] == (g[1] if turbo is None else TurboFormat(turbo.mode, g[1]).row_bytes)
                for c, g in zip(kv_caches, self._kv_geometry, strict=True)
            )
            and native.ready(positions, meta.slot_mapping, dtypes=(torch.int64,))
            and native.ready(meta.block_tables, meta.query_start_loc, meta.seq_lens, dtypes=(torch.int32,))
        )

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        meta: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings x [T, H] (overwritten) -> (last layer's MLP output, residual stream), each [T, H], or
        [len(output_rows), H] for just those token rows (every token's K/V still reach the caches). The caller
        checked :meth:`step_supported`."""
        assert meta.slot_mapping is not None and meta.block_tables is not None
        t, n = x.shape[0], len(self)
        rows = None if output_rows is None else output_rows.to(torch.int64).contiguous()
        turbo = self._turbo_format(kv_caches)
        turbo_signs = None if turbo is None else turbo_kv.channel_signs(turbo.head_dim)
        residual = torch.empty_like(x)
        gate_up = torch.empty(t, 2 * self._intermediate, dtype=x.dtype)
        self._stack.begin_step(
            kv_caches=[native.ptr(c) for c in kv_caches], num_tokens=t, positions=native.ptr(positions),
            slot_mapping=native.ptr(meta.slot_mapping), block_tables=native.ptr(meta.block_tables),
            max_blocks=meta.block_tables.shape[1], query_start_loc=native.ptr(meta.query_start_loc),
            seq_lens=native.ptr(meta.seq_lens), num_seqs=meta.seq_lens.shape[0], num_blocks=kv_caches[0].shape[1],
            block_size=kv_caches[0].shape[2], out_rows=_addr(rows), num_out_rows=0 if rows is None else rows.shape[0],
            cache_e4m3=kv_caches[0].dtype == torch.float8_e4m3fn,
            turbo_k_bits=0 if turbo is None else turbo.k_bits,
            turbo_signs=_addr(turbo_signs),
        )
        # SiLU-and-mul as ops.activation.silu_and_mul computes it on CPU (the same torch kernels on the same
        # strided views, in place and into preallocated buffers to save two dispatches per layer).
        act = torch.empty(t, self._intermediate, dtype=x.dtype)
        segment, xp, rp = self._stack.segment, native.ptr(x), native.ptr(residual)
        gp, ap = native.ptr(gate_up), native.ptr(act)
        out, inter = t, self._intermediate
        gate, up, a = gate_up[:, :inter], gate_up[:, inter:], act
        for i in range(n):
            if rows is not None and i == n - 1:
                out = rows.shape[0]
                gate, up, a = gate[:out], up[:out], act[:out]
            segment(i, ap if i else 0, gp, xp, rp)
            torch.mul(F.silu(gate, inplace=True), up, out=a)
        segment(n, ap, 0, xp, rp)
        return x[:out], residual[:out]


def _native_parts(parts: Sequence[tuple[torch.Tensor, int, int]]) -> Parts:
    return [(native.ptr(data), int(qtype), int(rows)) for data, qtype, rows in parts]
