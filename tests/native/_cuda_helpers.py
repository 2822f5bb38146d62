"""Helpers shared by the CUDA kernel tests: relative-error checks and allocator poisoning."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

# ||out - ref|| / ||ref|| bounds per storage dtype (outputs rounded once to that dtype, f32 accumulation).
REL_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()  # references may be computed on the host
    assert torch.isfinite(got).all(), "output holds NaN/inf (unwritten or overflowed elements)"
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def gemm_case(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random x [m, k] and weight [n, k] (scaled by 1/sqrt(k), so outputs stay O(1)) on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, generator=g, device="cuda").to(dtype)
    w = (torch.randn(n, k, generator=g, device="cuda") / k**0.5).to(dtype)
    return x, w


def poison_allocator(device: torch.device, numel: int) -> None:
    """Fill and free a block of NaNs, so the next allocations of the caching allocator start as NaN and an
    element a kernel forgets to write shows up as NaN instead of a plausible stale value."""
    junk = torch.full((numel,), float("nan"), dtype=torch.float32, device=device)
    del junk


def assert_greedy_equal_up_to_ties(got: list, want: list, length: int, label: str = "", tol: float = 0.02) -> None:
    """Greedy outputs (RequestOutput lists, ``want`` with logprobs) agree token for token, except that the first
    difference in a sequence may be a near-tie in ``want``'s logprobs (then the rest of it is not compared)."""
    for g, w in zip(got, want, strict=True):
        g_ids, w_ids = g.outputs[0].token_ids, w.outputs[0].token_ids
        assert len(g_ids) == len(w_ids) == length
        for i, (a, b) in enumerate(zip(g_ids, w_ids, strict=True)):
            if a != b:
                top = w.outputs[0].logprobs[i]
                assert a in top and top[b].logprob - top[a].logprob < tol, f"{label} step {i}: {a} vs {b}, {top}"
                break


def write_tiny_model_dir(path: Path, config: dict, vocab: int) -> Path:
    """A model directory LLM(load_format="dummy") can serve: ``config`` as config.json and a word-level tokenizer
    of ``vocab`` tokens t0, t1, ..."""
    (path / "config.json").write_text(json.dumps(config))
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return path
