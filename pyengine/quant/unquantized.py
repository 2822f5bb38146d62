"""Dense weights (safetensors, or F32/F16/BF16 GGUF tensors) multiplied with ``F.linear``, or on CUDA with
the native decode GEMMs that read the weight once: the skinny kernel up to 16 rows, and up to 64 the TMA/wgmma
kernel on Hopper for weights whose row tiles fill several waves (the LM head), both f16/bf16. The gate/up
projection on CUDA is stored [in, out] instead (``x @ W``): cuBLASLt's 17+ row GEMMs read that layout faster, and
``ops.cuda_kn.skinny_gemm_kn`` takes its decode batches."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from candle_vllm.pyengine.ops import cuda, cuda_kn, cuda_wide
from candle_vllm.pyengine.ops.activation import (
    deinterleave_gate_up,
    interleave_gate_up,
    silu_and_mul_interleaved,
)
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation, dense
from candle_vllm.pyengine.ops.rotary import RopeCacheTarget
from candle_vllm.pyengine.ops.row_pairs import interleave_halves
from candle_vllm.pyengine.quant.base import LinearMethod

KN_ENV = "CANDLE_VLLM_KN_GATE_UP"


class UnquantizedLinear(LinearMethod):
    """A plain [out, in] weight in the model dtype ([in, out] where ``kn``).

    ``gate_up_interleaved``: the weight is a fused [gate; up] projection, stored with its rows interleaved in
    groups of 8 (``ops.activation.interleave_gate_up``) so :meth:`forward_swiglu`'s decode GEMM applies the SiLU
    in its epilogue; :meth:`forward` still returns the [gate, up] layout.

    ``rope_rows`` / ``head_dim``: the weight is a fused q/k/v projection whose first ``rope_rows`` rows (the q and
    k heads) are stored with each head's halves interleaved in groups of 8 (``ops.row_pairs.interleave_halves``)
    so :meth:`forward_rope_cache`'s decode GEMM applies neox RoPE and stores k/v in its epilogue; :meth:`forward`
    returns the q/k heads in that paired layout (``rope_pair_group`` 8), which the RoPE kernels read and leave in the
    standard one (a gather back would cost more than the rotation).

    ``kn``: the (interleaved gate/up) weight on a Hopper GPU is kept transposed, [in, out] (in % 16 == 0, out % 64
    == 0): batch-64 decode of Llama-3-8B ran 1.0 % faster with cuBLASLt reading gate/up that way (H200, session 30:
    9,672 against 9,573 tok/s, three rounds each), and ``ops.cuda_kn`` takes its 1-16-row batches. Other GPUs keep
    [out, in] (not measured there), and so does ``CANDLE_VLLM_KN_GATE_UP=0`` (an A/B switch, read at load).
    """

    def __init__(
        self, weight: torch.Tensor, gate_up_interleaved: bool = False, rope_rows: int = 0, head_dim: int = 0
    ) -> None:
        super().__init__()
        self.gate_up_interleaved = gate_up_interleaved
        self.rope_rows, self.head_dim = rope_rows, head_dim
        if gate_up_interleaved:
            weight = interleave_gate_up(weight)
        elif rope_rows:
            weight = torch.cat([interleave_halves(weight[:rope_rows], head_dim), weight[rope_rows:]])
        self.out_features, self.in_features = weight.shape
        self.kn = (
            gate_up_interleaved
            and weight.device.type == "cuda"
            and torch.cuda.get_device_capability(weight.device)[0] == 9
            and os.environ.get(KN_ENV, "1").strip() != "0"
            and self.out_features % cuda_kn.STRIP == 0
            and self.in_features % cuda_kn.SLAB == 0
        )
        self.weight = nn.Parameter(weight.t().contiguous() if self.kn else weight, requires_grad=False)

    def _decode_kernel(self, x: torch.Tensor) -> str | None:
        """Which native GEMM takes this batch: the skinny one up to 16 rows (``skinny_kn`` for a ``kn`` weight), the
        wide one up to 64 where it beats cuBLASLt (``cuda_wide.wide_gemm_preferred``), else none (cuBLAS through
        torch)."""
        if x.device.type != "cuda":
            return None
        if self.kn:
            return "skinny_kn" if cuda_kn.skinny_gemm_kn_supported(x, self.weight) else None
        if cuda.skinny_gemm_supported(x, self.weight):
            return "skinny"
        if cuda_wide.wide_gemm_preferred(x, self.weight):
            return "wide"
        return None

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        kernel = self._decode_kernel(x)
        if kernel == "skinny":
            return cuda.skinny_gemm(x, self.weight)
        if kernel == "wide":
            return cuda_wide.wide_gemm(x, self.weight)
        if kernel == "skinny_kn":
            return cuda_kn.skinny_gemm_kn(x, self.weight)
        return torch.matmul(x, self.weight) if self.kn else F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._matmul(x)
        return deinterleave_gate_up(y) if self.gate_up_interleaved else y

    @property
    def rope_pair_group(self) -> int:
        return 8 if self.rope_rows else 0

    def forward_rope_cache(self, x: torch.Tensor | Q8Activation, target: RopeCacheTarget) -> torch.Tensor | None:
        """The projection with q/k rotated and k/v stored at their slots (``cuda.skinny_gemm_rope_cache``), for a
        decode batch of a weight stored with interleaved halves; None (nothing done) elsewhere."""
        x = dense(x)  # this method takes no int8 codes (q8_group 0), so x comes dense
        if not self.rope_rows or x.device.type != "cuda":
            return None
        return cuda.skinny_gemm_rope_cache(x, self.weight, self.head_dim, *target)

    def forward_swiglu(self, x: torch.Tensor, norm: DeferredRMSNorm | None = None) -> torch.Tensor | None:
        """silu(gate) * up: decode batches take a native GEMM with the SiLU in its epilogue, larger ones (and a
        deferred ``norm``, which those epilogues lack) the GEMM then the interleaved SiLU kernel; None for a weight
        that is not an interleaved gate/up pair."""
        if not self.gate_up_interleaved:
            return None
        kernel = self._decode_kernel(x) if norm is None else None
        if kernel == "skinny":
            return cuda.skinny_gemm(x, self.weight, silu_mul=True)
        if kernel == "wide":
            return cuda_wide.wide_gemm(x, self.weight, silu_mul=True)
        if kernel == "skinny_kn":
            return cuda_kn.skinny_gemm_kn(x, self.weight, silu_mul=True)
        return silu_and_mul_interleaved(self._matmul(x), norm)

    def add_into(self, x: torch.Tensor, out: torch.Tensor) -> bool:
        """``out += x @ W.T`` as one cuBLAS GEMM with beta = 1 (batches the native decode GEMMs do not take)."""
        if self.gate_up_interleaved or x.dim() != 2 or self._decode_kernel(x) is not None:
            return False
        out.addmm_(x, self.weight.t())
        return True

    def scale_input_columns(self, scale: torch.Tensor) -> None:
        """``W[:, k] *= scale[k]`` in place (an RMSNorm's weight moved into the linear after it, see
        ``ops.norm.DeferredRMSNorm``): in f32, rounded once, in chunks of 16M elements (no f32 copy of a 28k-row
        weight); a transposed weight (``kn``) scales its rows."""
        w, s = self.weight.data, scale.to(self.weight.device, torch.float32)
        step = max(1, (1 << 24) // w.shape[1])
        for start in range(0, w.shape[0], step):
            rows = w[start : start + step]
            rows.copy_(rows.float() * (s[start : start + step, None] if self.kn else s))
