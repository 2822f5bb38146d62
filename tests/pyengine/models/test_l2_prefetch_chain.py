"""The decode-order chain of weight prefetches (each linear warms the next one's weights in L2)."""

from __future__ import annotations

import itertools

import torch
from tiny_models import BASE

from candle_vllm.pyengine.config import config_from_hf_dict
from candle_vllm.pyengine.loader.dummy import dummy_weights
from candle_vllm.pyengine.models.llama import LlamaForCausalLM

TINY_LLAMA = {**BASE, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}


def _model(tied: bool) -> LlamaForCausalLM:
    cfg = config_from_hf_dict({**TINY_LLAMA, "tie_word_embeddings": tied})
    model = LlamaForCausalLM(cfg, torch.float32, torch.device("cpu"))
    model.load_weights(dummy_weights(model.expected_weights(), torch.float32, torch.device("cpu"), seed=1))
    model.finish_loading()
    return model


def test_each_linear_prefetches_the_one_that_runs_next() -> None:
    for tied in (False, True):
        model = _model(tied)
        order = []
        for layer in model.model.layers:
            order += [layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj]
        order.append(model.lm_head)
        methods = [m for lin in order for m in lin.methods]
        for method, following in itertools.pairwise(methods):
            assert method.prefetch_next is not None and method.prefetch_next.data_ptr() == following.storage.data_ptr()
        assert methods[-1].prefetch_next is None
        # The last decoder linear warms the LM head, which is the embedding matrix when tied.
        head = (model.model.embed_tokens.method if tied else model.lm_head.methods[0]).storage
        assert methods[-2].prefetch_next.data_ptr() == head.data_ptr()
        # References only: nothing new among the parameters or buffers.
        assert len(list(model.parameters())) == len({p.data_ptr() for p in model.parameters()})
