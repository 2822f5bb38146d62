"""The Llama family in one module: Llama (1-3.x), Mistral, Yi, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), SmolLM.

They differ only in switches the config carries (bias, q/k norm, sliding window, tied embeddings, rope
scaling), so one implementation serves all of them. Weights are named as in HF checkpoints; the GGUF
loader maps llama.cpp names onto these (``GGUF_NAMES``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from typing import Literal, cast

import torch
from torch import nn

from candle_vllm.pyengine.config import ModelConfig
from candle_vllm.pyengine.kv_cache.turbo import TurboFormat
from candle_vllm.pyengine.layers import Attention, Linear, RMSNorm, RotaryEmbedding, VocabEmbedding
from candle_vllm.pyengine.layers.module_list import module_list
from candle_vllm.pyengine.models.base import CausalLM
from candle_vllm.pyengine.ops import cuda_turbo, native
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.cpu_decoder import CpuDecoderStack
from candle_vllm.pyengine.ops.cuda import cache_holds
from candle_vllm.pyengine.ops.cuda_rotary import rope_paired_head_dim_ok
from candle_vllm.pyengine.ops.norm import DeferredRMSNorm
from candle_vllm.pyengine.ops.q8_activation import Q8Activation, dense
from candle_vllm.pyengine.ops.rotary import FUSED_CACHE_MAX_TOKENS, RopeCacheTarget, apply_rotary_and_cache
from candle_vllm.pyengine.quant import GGUFLinear, WeightData

# llama.cpp tensor names (after ``blk.N.``) -> HF names (after ``model.layers.N.``).
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Step sizes whose layers run with their norms deferred (LlamaDecoderLayer.forward_folded) once the norm weights are
# folded: over the skinny GEMM's 16 rows, whose fused epilogues (SiLU, RoPE + cache) take no deferred norm, and up to
# where the RoPE kernel still stores the cache (it applies the deferred scale). The wide GEMM's SiLU epilogue (17-64
# rows, weights that fill several waves) takes none either: such a gate_up runs its SiLU kernel in these steps.
DEFERRED_NORM_TOKENS = range(17, FUSED_CACHE_MAX_TOKENS + 1)
FOLD_NORMS_ENV = "CANDLE_VLLM_FOLD_NORMS"  # "0": loading on CUDA keeps the norms (an A/B switch for benchmarks)
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)$")
# HF projection name -> (fused layer attribute path, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}


def hf_name_from_gguf(name: str) -> str | None:
    """HF weight name of a llama.cpp tensor name, or None for tensors the model does not use."""
    m = _GGUF_LAYER_RE.match(name)
    if m:
        hf = GGUF_LAYER_NAMES.get(m.group(2))
        return f"model.layers.{m.group(1)}.{hf}.{m.group(3)}" if hf else None
    stem, _, kind = name.rpartition(".")
    hf = GGUF_GLOBAL_NAMES.get(stem)
    return f"{hf}.{kind}" if hf else None


class LlamaAttention(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        h, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.sizes = [h * d, hk * d, hk * d]
        self.head_dim, self.kv_heads = d, hk
        # The decode GEMM can rotate and cache in its epilogue when RoPE is neox over whole heads and nothing
        # (q/k norm, bias) sits between the projection and the rotation.
        fusable = (rotary.is_neox and rotary.cos_sin_cache.shape[-1] == d and rope_paired_head_dim_ok(d)
                   and not cfg.qk_norm and not cfg.attention_bias)
        self.qkv_proj = Linear(cfg.hidden_size, self.sizes, cfg.attention_bias, dtype, device,
                               rope_head_dim=d if fusable else 0)
        self.o_proj = Linear(h * d, [cfg.hidden_size], cfg.o_proj_bias, dtype, device)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype, device) if cfg.qk_norm else None
        self.rotary = rotary
        self.attn = Attention(h, hk, d, d**-0.5, cfg.layer_sliding_window(layer))

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | Q8Activation,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
        *,
        norm: DeferredRMSNorm | None = None,
        add_to: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[T, H] -> [T, H], or [len(rows), H] for only ``rows`` (every token's K/V still reach the cache).
        x may carry int8 codes for qkv_proj (``qkv_proj.q8_group``). ``norm``: x is the raw residual stream, its
        RMSNorm deferred (:class:`DeferredRMSNorm`): q, k and v take each token's 1/rms after the projection.
        ``add_to``: the output is added into that tensor (in o_proj's GEMM where it can), which is returned."""
        t, d = dense(x).shape[0], self.head_dim
        slots = meta.slot_mapping
        qkv = self.qkv_proj.forward_rope_cache(x, RopeCacheTarget(
            self.kv_heads, positions, self.rotary.cos_sin_cache, kv_cache, slots
        )) if kv_cache is not None and slots is not None and norm is None else None
        cached = qkv is not None  # rotated and cached by the projection's own kernel
        q, k, v = (qkv if qkv is not None else self.qkv_proj(x)).split(self.sizes, dim=-1)
        q, k, v = q.reshape(t, -1, d), k.reshape(t, -1, d), v.reshape(t, -1, d)
        if not cached:
            if self.q_norm is not None and self.k_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            group = self.qkv_proj.rope_pair_group  # q/k heads as the weight stores them: halves interleaved
            cached = kv_cache is not None and slots is not None and apply_rotary_and_cache(
                q, k, v, positions, self.rotary.cos_sin_cache, self.rotary.is_neox, kv_cache, slots,
                group, norm,
            )
            if not cached:
                if norm is not None:
                    q, k, v = norm.apply(q), norm.apply(k), norm.apply(v)
                q, k = self.rotary(positions, q, k, group)
        out = self.attn(q, k, v, kv_cache, meta, kv_cached=cached)
        out = out if rows is None else out[rows]
        return self.o_proj(out) if add_to is None else self.o_proj.add_into(out, add_to)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        i = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, [i, i], False, dtype, device, gated=True)
        self.down_proj = Linear(i, [cfg.hidden_size], False, dtype, device)

    def forward(
        self, x: torch.Tensor | Q8Activation, *, norm: DeferredRMSNorm | None = None, add_to: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x may carry int8 codes for gate_up_proj; the SiLU writes them for down_proj where it takes them.
        ``norm`` and ``add_to`` as :meth:`LlamaAttention.forward`'s (the SiLU applies the deferred scale)."""
        a = self.gate_up_proj.forward_swiglu(x, q8=self.down_proj.q8_group(dense(x).shape[0]), norm=norm)
        return self.down_proj(a) if add_to is None else self.down_proj.add_into(a, add_to)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer: int, rotary: RotaryEmbedding, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = LlamaAttention(cfg, layer, rotary, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = LlamaMLP(cfg, dtype, device)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """With ``rows``, everything after the attention runs for those token rows only. The norms write int8
        codes for the linears after them where those take them (GGUF weights, decode batches on CUDA)."""
        q8 = self.self_attn.qkv_proj.q8_group(x.shape[0])
        if residual is None:
            residual = x
            h = self.input_layernorm(x, q8=q8)
        else:
            h, residual = self.input_layernorm(x, residual, q8=q8)
        x = self.self_attn(positions, h, kv_cache, meta, rows)
        if rows is not None:
            residual = residual[rows]
        h, residual = self.post_attention_layernorm(x, residual, q8=self.mlp.gate_up_proj.q8_group(x.shape[0]))
        return self.mlp(h), residual

    def forward_folded(
        self,
        positions: torch.Tensor,
        residual: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`forward` over the residual stream alone, for a layer whose norm weights sit in qkv_proj and
        gate_up_proj (:meth:`LlamaForCausalLM.fold_norms`): the projections take the raw residual, the RoPE +
        cache kernel and the SiLU apply each norm's 1/rms, and o_proj / down_proj add into the residual in their
        GEMMs. Two launches fewer per layer; updates ``residual`` in place and returns it (with ``rows``: a new
        tensor of those rows, updated, ``residual`` left as it was)."""
        attn_norm = DeferredRMSNorm(residual, self.input_layernorm.eps)
        out = residual if rows is None else residual[rows]
        out = self.self_attn(positions, residual, kv_cache, meta, rows, norm=attn_norm, add_to=out)
        return self.mlp(out, norm=DeferredRMSNorm(out, self.post_attention_layernorm.eps), add_to=out)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        # One cos/sin table for all layers (it can be tens of MB at long contexts).
        rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling, True, device,
            cfg.rope_freq_factors,
        )
        self.layers = module_list(
            LlamaDecoderLayer(cfg, i, rotary, dtype, device) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)


class LlamaForCausalLM(CausalLM):
    """Decoder-only Llama-family LM over a flat token batch (contract C)."""

    hf_name_from_gguf = staticmethod(hf_name_from_gguf)
    supports_output_rows = True  # forward(..., output_rows=...): the runner may ask for the sampled rows only
    use_cpu_decoder_stack = True  # CPU steps through the fused native layers where they apply (same bits)

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        if config.extra.get("mlp_bias"):
            raise ValueError("mlp_bias=true is not supported by the Llama family implementation")
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported by the Llama family (only 'silu')")
        self.config = config
        self.model = LlamaModel(config, dtype, device)
        self.lm_head = Linear(config.hidden_size, [config.vocab_size], False, dtype, device)
        self.kv_caches: list[torch.Tensor] = []  # set by the engine, one per layer
        self.norms_folded = False  # fold_norms
        # Built on the first CPU step; None: unsupported.
        self._cpu_stack: CpuDecoderStack | Literal[False] | None = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata,
        output_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Token ids [T] at absolute positions [T] -> final-normed hidden states [T, H].

        ``output_rows`` (int64 indices into the T tokens, non-empty) returns only those rows' states
        [len(output_rows), H]: the last layer then runs its o_proj and MLP for them alone (a 4k-token prefill
        that samples one token skips ~1/32 of its linear FLOPs); its K/V still cover every token.
        """
        x = self.model.embed_tokens(input_ids)
        stack = self.cpu_decoder_stack() if self.use_cpu_decoder_stack and x.device.type == "cpu" else None
        residual: torch.Tensor | None = None
        if stack is not None and stack.step_supported(x, positions, self.kv_caches, attn):
            x, residual = stack.run(x, positions, self.kv_caches, attn, output_rows)
        else:
            folded = self.norms_folded and x.shape[0] in DEFERRED_NORM_TOKENS and self._rope_kernel_writes_caches(x)
            last = len(self.model.layers) - 1
            for i, layer in enumerate(self.model.layers):
                kv_cache = self.kv_caches[i] if self.kv_caches else None
                rows = output_rows if i == last else None
                if folded:
                    x = layer.forward_folded(positions, x, kv_cache, attn, rows)  # x: the residual stream
                else:
                    x, residual = layer(positions, x, residual, kv_cache, attn, rows)
            if folded:
                return self.model.norm(x)
        x, _ = self.model.norm(x, residual)
        return x

    def _rope_kernel_writes_caches(self, x: torch.Tensor) -> bool:
        """Whether a RoPE + cache kernel, which applies the attention's deferred norm, writes this model's KV
        caches: dense ones of x's dtype, or TurboQuant rows on CUDA. Elsewhere the deferred scale would fall to
        the torch reference three times a layer (+2.6 ms a batch-64 step, RESULTS.md session 42): such steps run
        the norms instead."""
        if not self.kv_caches or cache_holds(self.kv_caches[0], x.dtype):
            return True
        fmt = TurboFormat.of_cache(self.kv_caches[0], self.config.head_dim)
        return x.device.type == "cuda" and cuda_turbo.turbo_supported(x, self.kv_caches[0], fmt)

    def fold_norms(self) -> bool:
        """Move each layer's two RMSNorm weights into the columns of the linear after them (qkv_proj, gate_up_proj)
        and leave unit weights, so steps of ``DEFERRED_NORM_TOKENS`` tokens run the layers without norm launches
        (:meth:`LlamaDecoderLayer.forward_folded`) while the others run the norms as before. Only for dense
        projections, and without q/k norms or a qkv bias (nothing may sit between the projection and the kernel
        that applies the deferred scale); not in f16, whose range the unscaled projections (rms(x) times the
        normed ones, often 50 and more on a BOS token) could overflow. Returns whether the norms are folded."""
        c, layers = self.config, self.model.layers
        if self.norms_folded or c.qk_norm or c.attention_bias or self.model.norm.weight.dtype == torch.float16:
            return self.norms_folded
        if not all(layer.self_attn.qkv_proj.dense and layer.mlp.gate_up_proj.dense for layer in layers):
            return False
        with torch.inference_mode():  # the loader makes the weights as inference tensors
            for layer in layers:
                for norm, linear in ((layer.input_layernorm, layer.self_attn.qkv_proj),
                                     (layer.post_attention_layernorm, layer.mlp.gate_up_proj)):
                    linear.fold_input_scale(norm.weight)
                    norm.weight.data.fill_(1)
        self.norms_folded = True
        return True

    def cpu_decoder_stack(self) -> CpuDecoderStack | None:
        """The layers as native calls (one per layer) for CPU steps, built once; None when a layer does not fit
        (dense torch weights, activations other than f32, no native module)."""
        if self._cpu_stack is False:
            self._cpu_stack = _build_cpu_stack(self.model)
        return self._cpu_stack or None

    def compute_logits(self, hidden: torch.Tensor, *, f32: bool = True) -> torch.Tensor:
        """Hidden states [N, H] (only the rows that need logits) -> logits [N, V], f32 or, with ``f32=False``, in
        the LM head's dtype: the sampler converts only when a row needs more than the argmax (on the H200 the f32
        copy of a batch-64 step's 128k-vocab logits costs 25 us)."""
        logits = self.lm_head(hidden)
        return logits.float() if f32 else logits

    def expected_weights(self) -> dict[str, tuple[int, ...]]:
        """HF name -> shape of every checkpoint tensor this model needs (lm_head only when untied)."""
        c = self.config
        h, hk, d, hid, i = c.num_heads, c.num_kv_heads, c.head_dim, c.hidden_size, c.intermediate_size
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, hid), "model.norm.weight": (hid,)}
        if not c.tie_word_embeddings:
            out["lm_head.weight"] = (c.vocab_size, hid)
        for n in range(c.num_layers):
            p = f"model.layers.{n}."
            out |= {
                p + "input_layernorm.weight": (hid,),
                p + "post_attention_layernorm.weight": (hid,),
                p + "self_attn.q_proj.weight": (h * d, hid),
                p + "self_attn.k_proj.weight": (hk * d, hid),
                p + "self_attn.v_proj.weight": (hk * d, hid),
                p + "self_attn.o_proj.weight": (hid, h * d),
                p + "mlp.gate_proj.weight": (i, hid),
                p + "mlp.up_proj.weight": (i, hid),
                p + "mlp.down_proj.weight": (hid, i),
            }
            if c.attention_bias:
                out |= {p + f"self_attn.{x}_proj.bias": (s,) for x, s in zip("qkv", (h * d, hk * d, hk * d), strict=True)}
            if c.o_proj_bias:
                out[p + "self_attn.o_proj.bias"] = (hid,)
            if c.qk_norm:
                out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
        return out

    def load_weights(self, weights: Iterable[tuple[str, WeightData]]) -> set[str]:
        """Load HF-named tensors (any subset, any order); returns the names used. Unknown names raise
        KeyError, except known extras (rotary ``inv_freq`` buffers, an lm_head that tied models ignore)."""
        loaded: set[str] = set()
        for name, w in weights:
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.config.tie_word_embeddings):
                continue
            self._load_one(name, w)
            loaded.add(name)
        return loaded

    def tie_lm_head(self) -> None:
        self.config.tie_word_embeddings = True  # finish_loading then binds the head; the engine sees it too

    def finish_loading(self) -> None:
        """Called once all weights are in: binds a tied LM head to the embedding; on CUDA folds the norms
        (:meth:`fold_norms`; batch-64 decode +2 %, RESULTS.md) unless ``CANDLE_VLLM_FOLD_NORMS=0``."""
        if self.config.tie_word_embeddings:
            self.lm_head.tie_to(self.model.embed_tokens)
        if self.model.norm.weight.device.type == "cuda" and os.environ.get(FOLD_NORMS_ENV, "1").strip() != "0":
            self.fold_norms()

    def _load_one(self, name: str, w: WeightData) -> None:
        if name == "model.embed_tokens.weight":
            self.model.embed_tokens.load(w)
        elif name == "lm_head.weight":
            self.lm_head.load_shard(0, w)
        elif name == "model.norm.weight":
            _copy_dense(self.model.norm.weight, w)
        else:
            m = _HF_LAYER_RE.match(name)
            if m is None or int(m.group(1)) >= len(self.model.layers):
                raise KeyError(name)
            layer = self.model.layers[int(m.group(1))]
            stem, kind = m.group(2), m.group(3)
            if stem in _FUSED:
                path, shard = _FUSED[stem]
                target = cast(Linear, layer.get_submodule(path))
                if kind == "weight":
                    target.load_shard(shard, w)
                else:
                    target.load_bias(shard, _dense(w))
            else:
                norm = layer.get_submodule(stem) if kind == "weight" else None
                if not isinstance(norm, RMSNorm):
                    raise KeyError(name)
                _copy_dense(norm.weight, w)


def _gguf_parts(linear: Linear) -> list[tuple[torch.Tensor, int, int]] | None:
    methods = [m for m in linear.methods if isinstance(m, GGUFLinear) and m.data.is_contiguous()]
    if not methods or len(methods) != len(linear.methods):
        return None
    return [(m.data, int(m.qtype), m.out_features) for m in methods]


def _build_cpu_stack(model: LlamaModel) -> CpuDecoderStack | None:
    if model.norm.weight.dtype != torch.float32 or model.norm.weight.device.type != "cpu" or native.module() is None:
        return None
    stack = CpuDecoderStack()
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        parts = [_gguf_parts(lin) for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
        if any(p is None for p in parts) or attn.attn.softcap is not None or attn.o_proj.bias is not None:
            return None
        qkv, o, gate_up, down = parts
        stack.add_layer(
            num_heads=attn.attn.num_heads, num_kv_heads=attn.attn.num_kv_heads, head_dim=attn.head_dim,
            eps=layer.input_layernorm.eps, scale=attn.attn.scale, sliding_window=attn.attn.sliding_window,
            input_norm=layer.input_layernorm.weight, post_norm=layer.post_attention_layernorm.weight,
            q_norm=attn.q_norm.weight if attn.q_norm is not None else None,
            k_norm=attn.k_norm.weight if attn.k_norm is not None else None,
            qkv=qkv, qkv_bias=attn.qkv_proj.bias, o=o, gate_up=gate_up, down=down,  # type: ignore[arg-type]
            cos_sin_cache=attn.rotary.cos_sin_cache, is_neox=attn.rotary.is_neox,
        )
    return stack


def _dense(w: WeightData) -> torch.Tensor:
    if not isinstance(w, torch.Tensor):
        raise ValueError(f"expected a dense tensor, got quantized {w.qtype.name}")
    return w


def _copy_dense(param: torch.Tensor, w: WeightData) -> None:
    t = _dense(w)
    if t.shape != param.shape:
        raise ValueError(f"shape {list(t.shape)} does not match the model's {list(param.shape)}")
    param.data.copy_(t)
