"""Decode CUDA graphs (``pyengine/cuda_graphs.py``): replayed logits against the eager model on the same cache,
padding rows that leave the cache untouched, and greedy generation with graphs equal to generation without."""

from __future__ import annotations

import ctypes
import json
import os
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from _cuda_helpers import gemm_case, rel_error
from tokenizers import Tokenizer, models, pre_tokenizers

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.config import config_from_hf_dict
from candle_vllm.pyengine.cuda_graphs import graph_batch_sizes
from candle_vllm.pyengine.kv_cache import allocate_kv_caches
from candle_vllm.pyengine.loader.dummy import dummy_weights
from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.ops import cuda
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.runner import ModelRunner

DEV = torch.device("cuda")
VOCAB = 512
# head_dim 64 (the decode kernel takes 64/128/256), GQA group 2.
TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "bfloat16",
}


def test_batch_buckets() -> None:
    assert graph_batch_sizes(256) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(1000)[-1] == 256


def _tiny_runner(block_size: int, num_blocks: int) -> ModelRunner:
    cfg = config_from_hf_dict(TINY_LLAMA)
    model = LlamaForCausalLM(cfg, torch.bfloat16, DEV)
    model.load_weights(dummy_weights(model.expected_weights(), torch.bfloat16, DEV, seed=3))
    model.finish_loading()
    caches = allocate_kv_caches(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                                torch.bfloat16, DEV)
    gen = torch.Generator(device=DEV).manual_seed(4)
    for c in caches:  # a random "history" for every block, so each context reads distinct K/V
        c.copy_(torch.randn(c.shape, generator=gen, device=DEV, dtype=torch.float32))
    return ModelRunner(model, caches, cfg.vocab_size, DEV)


@pytest.mark.cuda
def test_replayed_logits_equal_eager_logits() -> None:
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
    block_size, max_model_len, num_blocks = 16, 1024, 2000
    runner = _tiny_runner(block_size, num_blocks)
    assert runner.enable_cuda_graphs(max_num_seqs=40, max_model_len=max_model_len, block_size=block_size)
    graphs = runner.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    rng = random.Random(5)
    # Batch sizes below, at and between buckets (padding rows), on the skinny-GEMM (<= 16) and cuBLAS sides;
    # contexts from one token to the captured maximum (one and many split-KV partitions).
    for b, max_ctx in [(1, 1024), (3, 40), (5, 700), (8, 1), (13, 300), (17, 1024), (33, 90), (40, 500), (1, 2)]:
        seq_lens = [rng.randint(1, max_ctx) for _ in range(b)]
        seq_lens[0] = max_ctx
        blocks = rng.sample(range(num_blocks), sum(-(-s // block_size) for s in seq_lens))
        tables, at = [], 0
        for s in seq_lens:
            n = -(-s // block_size)
            tables.append(blocks[at : at + n])
            at += n
        width = max(len(t) for t in tables)
        ids = torch.tensor([rng.randrange(VOCAB) for _ in range(b)])
        pos = torch.tensor([s - 1 for s in seq_lens])
        slots = torch.tensor([t[(s - 1) // block_size] * block_size + (s - 1) % block_size
                              for t, s in zip(tables, seq_lens, strict=True)])
        table_arr = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        before = [c.clone() for c in runner.model.kv_caches]

        bucket = graphs.bucket_for(b, max(seq_lens), width)
        assert bucket == min(s for s in graphs.sizes if s >= b)
        with torch.inference_mode():
            _, got = graphs.run(bucket, ids.numpy(), pos.numpy(), slots.numpy(), lens.numpy(), table_arr.numpy())
            got = got.clone()
            written = [c.clone() for c in runner.model.kv_caches]
            meta = AttentionMetadata.build([1] * b, seq_lens, DEV, tables, block_size)
            want = runner.model.compute_logits(runner.model(ids.to(DEV), pos.to(DEV), meta))
        assert got.shape == (b, VOCAB)
        err = rel_error(got, want)
        assert err < 1e-2, f"batch {b} (bucket {bucket}), contexts up to {max_ctx}: logits rel error {err:.2e}"
        assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.9
        # The graph wrote the new tokens' K/V at their slots and nowhere else (padding rows have slot -1).
        flat_slots = slots.to(DEV)
        for old, new in zip(before, written, strict=True):
            old_flat, new_flat = old.view(2, -1, *old.shape[3:]), new.view(2, -1, *new.shape[3:])
            keep = torch.ones(old_flat.shape[1], dtype=torch.bool, device=DEV)
            keep[flat_slots] = False
            assert torch.equal(old_flat[:, keep], new_flat[:, keep])
            assert not torch.equal(old_flat[:, flat_slots], new_flat[:, flat_slots])


LAUNCH_COMPLETION_PORT, PROGRAMMATIC_EDGE = 2, 1  # cudaGraphKernelNodePortLaunchCompletion, ...DependencyTypeProgrammatic


class _EdgeData(ctypes.Structure):
    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte), ("type", ctypes.c_ubyte),
                ("reserved", ctypes.c_ubyte * 5)]


def _edges(graph: int) -> list[tuple[int, int]]:
    """Every edge's (outgoing port, type) in a captured, not yet instantiated CUDA graph, read through the CUDA 13
    runtime torch loaded (its cudaGraphGetEdges returns the edges' data)."""
    major = str(torch.version.cuda).split(".")[0]
    if int(major) < 13:
        pytest.skip(f"reads the graph's edges through CUDA 13's cudaGraphGetEdges; torch runs CUDA {major}")
    try:
        rt = ctypes.CDLL(f"libcudart.so.{major}")
    except OSError as err:
        pytest.fail(f"torch's CUDA runtime (libcudart.so.{major}) could not be opened: {err}")
    get = rt.cudaGraphGetEdges
    get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    get.restype = ctypes.c_int
    n = ctypes.c_size_t(0)
    assert get(graph, None, None, None, ctypes.byref(n)) == 0
    src, dst, data = (ctypes.c_void_p * n.value)(), (ctypes.c_void_p * n.value)(), (_EdgeData * n.value)()
    assert get(graph, src, dst, data, ctypes.byref(n)) == 0
    return [(e.from_port, e.type) for e in data]


@pytest.mark.cuda
def test_kernel_after_cublas_gemm_waits_for_it() -> None:
    """Captured after a cuBLAS GEMM (which never triggers its dependents), our kernel takes a programmatic edge from
    the GEMM's launch-completion port (cuda/common.cuh: PdlCapture): it launches while the GEMM runs, so it must
    still wait for the GEMM's output. The GEMM's output is NaN before every replay, and the GEMM runs ~1 ms."""
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90 or later")
    if "0" in (os.environ.get("CANDLE_VLLM_PDL"), os.environ.get("CANDLE_VLLM_PDL_LAUNCH_ORDER")):
        pytest.skip("launch-completion edges switched off by the environment")
    x, w = gemm_case(4096, 8192, 8192, torch.bfloat16, seed=11)
    mid = torch.empty(4096, 8192, device=DEV, dtype=torch.bfloat16)

    def step() -> torch.Tensor:
        torch.mm(x, w.t(), out=mid)
        out = cuda.silu_and_mul(mid)
        assert isinstance(out, torch.Tensor)
        return out

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph):
        got = step()
    assert (LAUNCH_COMPLETION_PORT, PROGRAMMATIC_EDGE) in _edges(graph.raw_cuda_graph())
    graph.instantiate()
    ref = (x.float() @ w.float().t()).to(torch.bfloat16).float()
    want = torch.nn.functional.silu(ref[:, :4096]) * ref[:, 4096:]
    for _ in range(5):
        mid.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_error(got, want) < 2e-2


def _model_dir(path: Path) -> Path:
    (path / "config.json").write_text(json.dumps({**TINY_LLAMA, "max_position_embeddings": 64}))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.cuda
@pytest.mark.parametrize("kvcache_dtype", ["auto", "fp8", "turbo4"])
def test_greedy_generation_with_graphs_equals_without(tmp_path: Path, kvcache_dtype: str) -> None:
    """Greedy tokens through ``LLM.generate``, with a bf16, an e4m3 and a TurboQuant KV cache. The context limit
    is 64 tokens, so the eager decode kernel and the graphs' (whose grid is fixed by that limit) both use one
    split-KV partition, and batches stay <= 16 rows (the skinny GEMM, whose rows do not depend on the batch): the two
    paths then agree bit for bit, so greedy choices may be compared exactly even between near-tied logits."""
    if not cuda.available(DEV):
        pytest.fail("candle_vllm._native was built without CUDA kernels")
    model = str(_model_dir(tmp_path))
    common = dict(load_format="dummy", dtype="bf16", mem=64, max_num_seqs=16, seed=0, kvcache_dtype=kvcache_dtype)
    eager = LLM(model=model, disable_cuda_graph=True, **common)
    graphed = LLM(model=model, **common)
    want_dtype = {"auto": torch.bfloat16, "fp8": torch.float8_e4m3fn, "turbo4": torch.uint8}[kvcache_dtype]
    assert {c.dtype for c in graphed.engine.runner.model.kv_caches} == {want_dtype}
    assert eager.engine.runner.graphs is None
    graphs = graphed.engine.runner.graphs
    assert graphs is not None
    replays: list[int] = []
    real_run = graphs.run

    def counted_run(bucket: int, *a: Any, **k: Any) -> tuple[torch.Tensor, torch.Tensor]:
        replays.append(bucket)
        return real_run(bucket, *a, **k)

    graphs.run = counted_run  # type: ignore[method-assign]
    rng = random.Random(7)
    for batch in (1, 3, 6, 11, 16):
        prompts = [{"prompt_token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(2, 30))]}
                   for _ in range(batch)]
        params = [SamplingParams(temperature=0, max_tokens=rng.randint(4, 30), ignore_eos=True) for _ in range(batch)]
        want = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
        got = [o.outputs[0].token_ids for o in graphed.generate(prompts, params)]
        assert got == want, f"batch {batch}"
        assert all(len(t) == p.max_tokens for t, p in zip(got, params, strict=True))
    assert {1, 2, 4, 8, 16} <= set(replays), f"graph buckets replayed: {sorted(set(replays))}"

