"""Write a transformers model as a llama.cpp-style GGUF with the ``gguf`` package, or a GGUF file again with its
tensors dequantized (test fixtures)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QT
from transformers import PreTrainedModel

LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
GLOBAL_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's q/k row order for llama.cpp's adjacent-pair (NORM) RoPE."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    stem, _, kind = hf_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, idx, rest = stem.split(".", 3)
        return f"blk.{idx}.{LAYER_NAMES[rest]}.{kind}"
    return f"{GLOBAL_NAMES[stem]}.{kind}"


def write_gguf(
    model: PreTrainedModel,
    path: Path,
    arch: str,
    qtype_of: Callable[[str], QT] = lambda name: QT.F32,
    split_max_tensors: int = 0,
) -> dict[str, torch.Tensor]:
    """Write ``model`` to ``path`` and return the HF state dict as the file holds it (rounded/quantized
    weights, dequantized by the gguf package) so the oracle model can be given exactly those values."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_vocab_size(c.vocab_size)
    as_stored: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        arr = t.float().numpy()
        gname = gguf_name(name)
        qtype = qtype_of(gname) if arr.ndim == 2 else QT.F32
        if qtype == QT.F32:
            stored = arr
        elif qtype == QT.F16:
            stored = arr.astype(np.float16)
        else:
            stored = gguf.quants.quantize(arr, qtype)
        as_stored[name] = torch.from_numpy(
            gguf.quants.dequantize(stored, qtype).reshape(arr.shape).astype(np.float32)
            if qtype not in (QT.F32, QT.F16) else stored.astype(np.float32)
        )
        if arch == "llama" and ".attn_q." in gname:
            stored = llamacpp_permute(stored, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gname:
            stored = llamacpp_permute(stored, c.num_key_value_heads)
        w.add_tensor(gname, stored, raw_dtype=qtype if qtype not in (QT.F32, QT.F16) else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if c.tie_word_embeddings:
        as_stored["lm_head.weight"] = as_stored["model.embed_tokens.weight"]
    return as_stored


def dequantized_copy(src: Path, dst: Path, matrix_dtype: type[np.floating] = np.float32) -> Path:
    """``src`` with every tensor dequantized by the gguf package, matrices stored as ``matrix_dtype`` (F32 or F16)
    and vectors as F32, every other field kept: the same model without the quantized types' rounding."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, str(reader.fields["general.architecture"].contents()))
    for f in reader.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(f.name, f.contents(), f.types[0], sub)
    for t in reader.tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape.tolist())))
        writer.add_tensor(t.name, a.astype(matrix_dtype if a.ndim == 2 else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
