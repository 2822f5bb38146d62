"""Offline throughput through the engine's own path (``LLM.generate``): N sequences with random input and
output lengths (ignore_eos), as vLLM's throughput benchmark, so scheduling, sampling and detokenization are
inside the figure.

    python benches/bench_offline.py                       # SmolLM2 GGUF on CPU, 32 sequences
    python benches/bench_offline.py --model benches/configs/llama-3-8b --load-format dummy --num-prompts 256
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from bench_decode import model_dir_with_tokenizer

from candle_vllm import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="as --m (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--num-prompts", type=int, default=None, help="default: 256 on CUDA, 32 elsewhere")
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-fraction", type=float, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model and args.load_format == "dummy" and not (Path(model) / "tokenizer.json").exists():
            model = str(model_dir_with_tokenizer(Path(model), Path(tmp)))  # a bare config (benches/configs)
        llm = LLM(model=model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                  kv_fraction=args.kv_fraction, seed=args.seed)
    device = llm.engine.info.device
    n = args.num_prompts or (256 if device.type == "cuda" else 32)
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    max_len = llm.engine.max_model_len
    prompts, params = [], []
    for _ in range(n):
        n_in = rng.randint(args.min_len, args.max_len)
        n_out = min(rng.randint(args.min_len, args.max_len), max_len - n_in)
        prompts.append({"prompt_token_ids": [rng.randrange(vocab) for _ in range(n_in)]})
        params.append(SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_in = sum(len(o.prompt_token_ids) for o in outputs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    result = {
        "model": llm.engine.info.model_name, "device": str(device), "dtype": str(llm.engine.info.dtype),
        "num_prompts": n, "input_tokens": n_in, "output_tokens": n_out, "seconds": round(elapsed, 3),
        "requests_per_s": round(n / elapsed, 3), "output_tokens_per_s": round(n_out / elapsed, 1),
        "total_tokens_per_s": round((n_in + n_out) / elapsed, 1), "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
