"""Llama-family model loaded from HF checkpoints against transformers (fp32, max |logit diff| <= 1e-4):
flat multi-sequence batches without a cache, and chunked prefill + decode through a paged KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import CASES, hf_logits, make_hf_model, save_hf_model

from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.ops.attention import AttentionMetadata

TOL = 1e-4
CPU = torch.device("cpu")


def _load(path: Path):
    return load_model(resolve_model_source(str(path)), torch.float32, CPU).model


@pytest.mark.parametrize("case", list(CASES))
def test_flat_batch_matches_transformers(case: str, tmp_path: Path) -> None:
    hf = make_hf_model(case)
    model = _load(save_hf_model(hf, tmp_path, sharded=case == "llama"))
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (40, 11)]
    ids = torch.cat(seqs)
    positions = torch.cat([torch.arange(len(s)) for s in seqs])
    with torch.inference_mode():
        got = model.compute_logits(model(ids, positions, AttentionMetadata.build([len(s) for s in seqs])))
    want = torch.cat([hf_logits(hf, s) for s in seqs])
    assert want.std() > 0.5, "oracle logits too flat for a meaningful comparison"
    assert (got - want).abs().max().item() <= TOL


@pytest.mark.parametrize("case", ["llama3_rope", "mistral_sliding", "qwen3_qk_norm", "smollm_tied"])
def test_paged_chunked_prefill_and_decode(case: str, tmp_path: Path) -> None:
    """Two sequences advance together: prefill chunks of different sizes, then one token per step."""
    hf = make_hf_model(case, seed=1)
    model = _load(save_hf_model(hf, tmp_path))
    block_size, num_blocks, cfg = 4, 20, model.config
    g = torch.Generator().manual_seed(8)
    model.kv_caches = [
        torch.randn(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g)
        for _ in range(cfg.num_layers)
    ]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (23, 17)]
    schedules = [[9, 5, 1, 1, 1, 3, 1, 1, 1], [3, 1, 6, 4, 1, 1, 1]]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables = [perm[:6], perm[6:11]]
    want = [hf_logits(hf, s) for s in seqs]
    done = [0, 0]
    for step in range(max(len(s) for s in schedules)):
        active = [i for i in range(2) if step < len(schedules[i])]
        qlens = [schedules[i][step] for i in active]
        meta = AttentionMetadata.build(
            qlens, [done[i] + q for i, q in zip(active, qlens, strict=True)], "cpu", [tables[i] for i in active], block_size
        )
        ids = torch.cat([seqs[i][done[i] : done[i] + q] for i, q in zip(active, qlens, strict=True)])
        pos = torch.cat([torch.arange(done[i], done[i] + q) for i, q in zip(active, qlens, strict=True)])
        with torch.inference_mode():
            got = model.compute_logits(model(ids, pos, meta))
        start = 0
        for i, q in zip(active, qlens, strict=True):
            diff = (got[start : start + q] - want[i][done[i] : done[i] + q]).abs().max().item()
            assert diff <= TOL, f"step {step} seq {i}: max diff {diff}"
            start += q
            done[i] += q
    assert done == [len(s) for s in seqs]


@pytest.mark.parametrize("case", ["llama3_rope", "qwen3_qk_norm"])
def test_output_rows_match_transformers(case: str, tmp_path: Path) -> None:
    """``output_rows``: the last layer runs o_proj/MLP for the chosen rows only; those rows' logits still equal
    transformers', and the K/V of every token reach the cache (a decode step after it is checked too)."""
    hf = make_hf_model(case, seed=2)
    model = _load(save_hf_model(hf, tmp_path))
    block_size, num_blocks, cfg = 4, 24, model.config
    g = torch.Generator().manual_seed(9)
    model.kv_caches = [
        torch.randn(2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, generator=g)
        for _ in range(cfg.num_layers)
    ]
    seqs = [torch.randint(0, 256, (n,), generator=g) for n in (19, 14)]
    want = [hf_logits(hf, s) for s in seqs]
    tables = [list(range(0, 6)), list(range(6, 11))]
    prefill = [18, 13]  # the last token of each sequence is decoded afterwards
    meta = AttentionMetadata.build(prefill, prefill, "cpu", tables, block_size)
    ids = torch.cat([s[:n] for s, n in zip(seqs, prefill, strict=True)])
    pos = torch.cat([torch.arange(n) for n in prefill])
    rows = torch.tensor([17, 3, 30])  # seq 0's last token, an inner row, seq 1's last token (any order)
    mlp_rows: list[int] = []
    hook = model.model.layers[-1].mlp.register_forward_hook(lambda _m, args, _out: mlp_rows.append(args[0].shape[0]))
    with torch.inference_mode():
        got = model.compute_logits(model(ids, pos, meta, output_rows=rows))
    hook.remove()
    assert mlp_rows == [3], "the last layer's MLP ran for more rows than asked"
    assert got.shape == (3, cfg.vocab_size)
    expected = torch.stack([want[0][17], want[0][3], want[1][12]])
    assert (got - expected).abs().max().item() <= TOL
    meta = AttentionMetadata.build([1, 1], [19, 14], "cpu", tables, block_size)
    with torch.inference_mode():
        got = model.compute_logits(model(torch.stack([seqs[0][18], seqs[1][13]]), torch.tensor([18, 13]), meta))
    assert (got - torch.stack([want[0][18], want[1][13]])).abs().max().item() <= TOL
