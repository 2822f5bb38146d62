"""Decode speed and time to first token through ``LLM.generate`` (scheduling, sampling and detokenization
inside every figure), each printed with its fraction of the memory-bandwidth roofline.

    python benches/bench_decode.py                                   # Llama-3-8B shapes, dummy bf16 weights
    python benches/bench_decode.py --output-len 256 --profile-steps 8 --json out.json
    python benches/bench_decode.py --isq q4k                          # weights quantized to GGUF Q4_K at load
    python benches/bench_decode.py --ttft-only --ttft-repeats 5 --profile-ttft      # prefill only

Figures: batch-1 decode at a 4k context (4k prompt, ``--output-len`` tokens), batch-64 decode at a 1k context,
TTFT of one 4k prompt (median of ``--ttft-repeats``, fresh random prompts so the prefix cache never hits).
Decode rates use the engine's own request timestamps: (tokens - 1) / (finished - first token).

The roofline of a decode step is the bytes it must read at the ceiling bandwidth (4.26 TB/s): every weight but
the embedding table once (14.96 GB of Llama-3-8B's 16.06 GB bf16) plus each sequence's K/V (128 KiB per token for
Llama-3-8B bf16): 3.65 ms at a 4k context. TTFT's roofline is the prefill's FLOPs at 790 TFLOP/s (bf16 dense).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, cast

import torch
from decode_profile import profile_decode, profile_ttft
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.models.llama import LlamaForCausalLM
from candle_vllm.pyengine.ops import cuda_prefill, sdpa_prefill
from candle_vllm.pyengine.quant.gguf import GGUFLinear

CEILING_BYTES_PER_S = 4.26e12  # H200 copy bandwidth (issue 5)


def model_dir_with_tokenizer(config_dir: Path, out: Path) -> Path:
    """A copy of a bare config directory plus a synthetic byte-level tokenizer of the config's vocab size.

    The engine needs a tokenizer and the real ones cannot be downloaded here; token-id prompts only need ids to
    exist and decode to text, so ``vocab_size`` distinct byte-level strings (no merges) stand in for them.
    """
    shutil.copy(config_dir / "config.json", out / "config.json")
    vocab_size = json.loads((config_dir / "config.json").read_text())["vocab_size"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab: dict[str, int] = {}
    for length in (1, 2, 3):
        for i in range(len(alphabet) ** length):
            if len(vocab) == vocab_size:
                break
            chars, rest = [], i
            for _ in range(length):
                rest, c = divmod(rest, len(alphabet))
                chars.append(alphabet[c])
            vocab["".join(chars)] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(out / "tokenizer.json"))
    return out


def _weights(llm: LLM) -> list[tuple[int, int]]:
    """(bytes, logical elements) of every weight a decode step reads: dense parameters and GGUF block buffers
    (``--isq``), except the embedding table (a step reads only B of its rows)."""
    model = cast(LlamaForCausalLM, llm.engine.runner.model)  # the one model class (models/registry.py)
    skip = {id(t) for t in [*model.model.embed_tokens.parameters(), *model.model.embed_tokens.buffers()]}
    out = [(p.numel() * p.element_size(), p.numel()) for p in model.parameters() if id(p) not in skip]
    for module in model.modules():
        if isinstance(module, GGUFLinear) and id(module.data) not in skip:
            out.append((module.data.numel(), module.out_features * module.in_features))
    return out


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights a decode step reads; for Llama-3-8B bf16 that is 14.96 GB."""
    return sum(b for b, _ in _weights(llm))


def weight_elements(llm: LLM) -> int:
    """Logical weight elements (the prefill's multiply-adds per token), whatever their storage."""
    return sum(n for _, n in _weights(llm))


def kv_bytes_per_token(llm: LLM) -> int:
    """Cache bytes a token takes over all layers (dense K/V halves or TurboQuant rows: dims 1-2 are the blocks)."""
    cache = llm.engine.runner.model.kv_caches[0]
    return llm.engine.model_config.num_layers * cache.numel() * cache.element_size() // (cache.shape[1] * cache.shape[2])


def random_prompts(rng: random.Random, n: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(length)]} for _ in range(n)]


def decode_rate(llm: LLM, prompts: list[dict[str, list[int]]], out_len: int) -> dict[str, float]:
    """Generate greedily (ignore_eos) and report the decode phase: from the last first token to the last finish.

    The prompts are prefilled once beforehand, so the measured run finds them in the prefix cache and every
    sequence takes its first token in the same step. Without that, a batch's prompts are prefilled over several
    chunked steps, the first ones decode (and finish) earlier, and ``len(outs) * steps`` over the window
    overcounts: batch-64 figures up to session 4 were biased up by this (10,079 tok/s with 16 output tokens vs
    9,284 with 64 on one machine)."""
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1))
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    outs = llm.generate(prompts, params)
    first = max(o.metrics.first_token_time or 0.0 for o in outs)
    last = max(o.metrics.finished_time or 0.0 for o in outs)
    steps = out_len - 1
    return {"seconds": last - first, "step_ms": 1e3 * (last - first) / steps,
            "tokens_per_s": len(outs) * steps / (last - first)}


def step_roofline_ms(w_bytes: int, kv_token_bytes: int, batch: int, context: int) -> float:
    return 1e3 * (w_bytes + batch * context * kv_token_bytes) / CEILING_BYTES_PER_S


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(Path(__file__).parent / "configs" / "llama-3-8b"))
    ap.add_argument("--load-format", default="dummy")
    ap.add_argument("--context", type=int, default=4096, help="batch-1 prompt length and TTFT prompt length")
    ap.add_argument("--output-len", type=int, default=1024, help="batch-1 generated tokens")
    ap.add_argument("--batch", type=int, default=64, help="sequences of the batch decode (0: none)")
    ap.add_argument("--batch-context", type=int, default=1024, help="prompt length of each batched sequence")
    ap.add_argument("--batch-output-len", type=int, default=128)
    ap.add_argument("--ttft-repeats", type=int, default=5)
    ap.add_argument("--ttft-pause", type=float, default=0.0, metavar="S",
                    help="idle the GPU S seconds before each TTFT prompt (a request reaching an idle server): back "
                         "to back, 4k prefills hold the H200 at its power cap, ~1.5 GHz instead of 1.98, ~7 %% slower")
    ap.add_argument("--profile-steps", type=int, default=0,
                    help="profile this many batch-1 decode steps (and as many batch-N steps with --profile-batch)")
    ap.add_argument("--profile-batch", action="store_true",
                    help="with --profile-steps: also profile the batch decode (--batch sequences at --batch-context)")
    ap.add_argument("--ttft-only", action="store_true", help="measure only the TTFT (skip both decode figures)")
    ap.add_argument("--profile-ttft", action="store_true", help="also profile one TTFT prefill (torch profiler)")
    ap.add_argument("--prefill-tiling", default=None, metavar="BM,WR,BN",
                    help="flash prefill tiling for the run (one of ops.cuda_prefill.KERNEL_CONFIGS; default: its "
                         "DEFAULT_CONFIG)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--disable-cuda-graph", action="store_true", help="run decode steps eagerly (no CUDA graphs)")
    ap.add_argument("--isq", default=None, help="quantize the weights while loading (q4k, q4_0, q8_0, q6k, ...)")
    ap.add_argument("--kvcache-dtype", default="auto", help="auto (the activation dtype), fp8 (e4m3), or turbo8 / turbo4 / turbo3")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    if args.prefill_tiling:
        tiling = tuple(int(x) for x in args.prefill_tiling.split(","))
        dims = [d for d, configs in cuda_prefill.KERNEL_CONFIGS.items() if tiling in configs]
        if not dims:
            ap.error(f"--prefill-tiling {args.prefill_tiling} is not compiled: {cuda_prefill.KERNEL_CONFIGS}")
        for head_dim in dims:
            cuda_prefill.DEFAULT_CONFIG[head_dim] = tiling  # type: ignore[assignment]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if args.load_format == "dummy" and not (Path(model) / "tokenizer.json").exists():
            model = str(model_dir_with_tokenizer(Path(model), Path(tmp)))
        t0 = time.perf_counter()
        llm = LLM(model=model, load_format=args.load_format, max_num_seqs=max(args.batch, 1), seed=args.seed,
                  disable_cuda_graph=args.disable_cuda_graph, isq=args.isq, kvcache_dtype=args.kvcache_dtype)
        load_s = time.perf_counter() - t0
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    w_bytes, kv_tok = weight_bytes(llm), kv_bytes_per_token(llm)
    llm.generate(random_prompts(rng, 1, 16, vocab), SamplingParams(max_tokens=4))  # warm-up
    res: dict[str, Any] = {"model": args.model, "isq": args.isq, "kvcache_dtype": args.kvcache_dtype, "device": torch.cuda.get_device_name() if torch.cuda.is_available()
                           else "cpu", "dtype": str(llm.engine.info.dtype), "load_s": round(load_s, 1),
                           "weight_gb": round(w_bytes / 1e9, 2),
                           "cuda_graphs": llm.engine.runner.graphs is not None}

    def report(name: str, value: float, unit: str, roofline: float, higher_is_better: bool) -> None:
        frac = value / roofline if higher_is_better else roofline / value
        res[name] = {"value": round(value, 2), "unit": unit, "roofline": round(roofline, 2), "fraction": round(frac, 3)}
        print(f"{name}: {value:.2f} {unit} (roofline {roofline:.2f} {unit}, {100 * frac:.1f} % of it)", flush=True)

    if not args.ttft_only:
        mid_ctx = args.context + args.output_len // 2
        b1 = decode_rate(llm, random_prompts(rng, 1, args.context, vocab), args.output_len)
        roof = 1e3 / step_roofline_ms(w_bytes, kv_tok, 1, mid_ctx)
        report("batch1_decode_tok_s", b1["tokens_per_s"], "tok/s", roof, True)
        res["batch1_step_ms"] = round(b1["step_ms"], 3)

    if not args.ttft_only and args.batch > 0:
        mid_bctx = args.batch_context + args.batch_output_len // 2
        bb = decode_rate(llm, random_prompts(rng, args.batch, args.batch_context, vocab), args.batch_output_len)
        roof = args.batch * 1e3 / step_roofline_ms(w_bytes, kv_tok, args.batch, mid_bctx)
        report(f"batch{args.batch}_decode_tok_s", bb["tokens_per_s"], "tok/s", roof, True)
        res[f"batch{args.batch}_step_ms"] = round(bb["step_ms"], 3)

    ttfts = []
    sdpa_prefill.ROUTES.clear()
    res["ttft_pause_s"] = args.ttft_pause
    for _ in range(args.ttft_repeats):
        time.sleep(args.ttft_pause)
        out = llm.generate(random_prompts(rng, 1, args.context, vocab), SamplingParams(max_tokens=1))[0]
        ttfts.append(1e3 * ((out.metrics.first_token_time or 0.0) - out.metrics.arrival_time))
    # Prefill roofline: compute-bound at ~790 TFLOP/s bf16 dense (2 * params * tokens + causal attention).
    c = llm.engine.model_config
    flops = 2 * weight_elements(llm) * args.context + 2 * c.num_layers * c.num_heads * c.head_dim * args.context ** 2
    if ttfts:  # --ttft-repeats 0 skips the TTFT
        report("ttft_ms", statistics.median(ttfts), "ms", 1e3 * flops / 790e12, False)
    res["ttft_all_ms"] = [round(t, 1) for t in ttfts]
    # Which prefill attention ran (CANDLE_VLLM_PREFILL, ops/sdpa_prefill.py): launches per backend over the TTFTs.
    res["prefill_attention"] = dict(sdpa_prefill.ROUTES)
    print(f"prefill attention ({sdpa_prefill.ENV}={sdpa_prefill.prefill_backend()}): "
          + ", ".join(f"{name} {n} launches" for name, n in sdpa_prefill.ROUTES.items()), flush=True)

    if args.profile_ttft:
        res["ttft_profile"] = profile_ttft(llm, random_prompts(rng, 1, args.context, vocab)[0], 30)
        print(res["ttft_profile"], flush=True)
    if args.profile_steps:
        res["profile"] = profile_decode(llm, random_prompts(rng, 1, args.context, vocab), args.profile_steps, 25)
        print(res["profile"], flush=True)
        if args.profile_batch:
            res["batch_profile"] = profile_decode(
                llm, random_prompts(rng, args.batch, args.batch_context, vocab), args.profile_steps, 25)
            print(res["batch_profile"], flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
