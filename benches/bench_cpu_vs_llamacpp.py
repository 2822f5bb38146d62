"""CPU decode speed against llama.cpp (llama-cpp-python) on the same GGUF, same thread count, same prompt:
greedy decode tokens/s for one sequence, prompt time excluded (runs of N and 1 output tokens, subtracted).

    python benches/bench_cpu_vs_llamacpp.py [--threads 2] [--tokens 128] [--op-by-op]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded SmolLM2 Q4_1)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--op-by-op", action="store_true",
                    help="run our decoder layers op by op (no fused native CPU layers), for before/after figures")
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)

    import torch
    from llama_cpp import Llama

    from candle_vllm import LLM, SamplingParams
    from candle_vllm.pyengine.loader.embedded import default_model_path
    from candle_vllm.pyengine.models.llama import LlamaForCausalLM

    LlamaForCausalLM.use_cpu_decoder_stack = not args.op_by_op

    torch.set_num_threads(args.threads)
    path = args.model or str(default_model_path())
    prompt = "Write a long story about a lighthouse keeper who finds a message in a bottle."

    ours = LLM(model=path, max_num_seqs=1)
    ids = ours.get_tokenizer().encode(prompt)

    def ours_run(n: int) -> float:
        t = time.perf_counter()
        ours.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        return time.perf_counter() - t

    ref = Llama(model_path=path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False)

    def llama_run(n: int) -> float:
        t = time.perf_counter()
        for count, _tok in enumerate(ref.generate(ids, temp=0.0, top_k=1, reset=True), start=1):
            if count == n:  # generate() never stops at EOS by itself: same token count as ignore_eos
                break
        return time.perf_counter() - t

    def decode_rate(run: Callable[[int], float]) -> float:
        run(8)  # warm-up
        rates = []
        for _ in range(args.repeats):
            rates.append((args.tokens - 1) / (run(args.tokens) - run(1)))
        return statistics.median(rates)

    ours_rate = decode_rate(ours_run)
    ref_rate = decode_rate(llama_run)
    result = {"model": os.path.basename(path), "threads": args.threads, "decode_tokens": args.tokens,
              "candle_vllm_tok_s": round(ours_rate, 1), "llama_cpp_tok_s": round(ref_rate, 1),
              "ratio": round(ours_rate / ref_rate, 3)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
