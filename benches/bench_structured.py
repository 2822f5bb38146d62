"""What structured output costs the requests that do not use it: tokens/s of unconstrained requests when they
share batches with grammar-constrained (json_schema) requests, against the same batches where the companions
are unconstrained but generate exactly as many tokens (so every step has the same rows; only masks differ).

    python benches/bench_structured.py                       # SmolLM2 GGUF on CPU, 8 + 8 requests
    python benches/bench_structured.py --unconstrained 32 --constrained 32 --repeats 3

Runs: ``alone`` (the unconstrained requests by themselves, for scale), ``matched`` (with unconstrained
companions of the constrained run's lengths) and ``constrained`` (with json_schema companions), alternating
``--repeats`` times. The drop that structured output causes is ``1 - constrained / matched`` of the unconstrained
requests' tokens/s, measured until the last of them ends. On a shared machine wall time swings with other
load and drifts over minutes, so the drop is the median over repeats of the ratio between a matched run and the
constrained run right after it, from wall time and from the process's CPU time (all threads), which other
processes move less; the fastest run of each kind is given too. ``grammar_work_share_pct`` is the direct cost:
the time spent filling masks, advancing matchers and applying masks in the sampler, as a share of the
constrained run's wall time (a ratio inside one run, so load on the machine barely moves it).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from candle_vllm import LLM, SamplingParams
from candle_vllm.pyengine.sampling import sampler as sampler_module
from candle_vllm.pyengine.sampling.params import StructuredOutputParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "color": {"enum": ["red", "green", "blue", "yellow"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "minItems": 2, "maxItems": 5},
        "bio": {"type": "string", "minLength": 20, "maxLength": 200},
    },
    "required": ["name", "age", "color", "hobbies", "bio"],
    "additionalProperties": False,
}


def chat_ids(llm: LLM, text: str) -> list[int]:
    tok = llm.get_tokenizer()
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


def run(llm: LLM, plain: list[tuple[list[int], SamplingParams]], companions: list[tuple[list[int], SamplingParams]]
        ) -> tuple[float, float, float, dict[str, int]]:
    """(wall s and CPU s until every plain request finished, wall s for all, output tokens of each request)."""
    engine = llm.engine
    for i, (ids, params) in enumerate(plain):
        engine.add_request(f"plain{i}", ids, params)
    for i, (ids, params) in enumerate(companions):
        engine.add_request(f"comp{i}", ids, params)
    pending = {f"plain{i}" for i in range(len(plain))}
    lengths: dict[str, int] = {}
    start, cpu_start = time.perf_counter(), time.process_time()
    plain_wall = plain_cpu = 0.0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                pending.discard(out.request_id)
                lengths[out.request_id] = len(out.outputs[0].token_ids)
                if not pending and not plain_wall:
                    plain_wall, plain_cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return plain_wall, plain_cpu, time.perf_counter() - start, lengths


def paired_drop(seconds: dict[str, list[float]]) -> float:
    """Median over repeats of 1 - (matched time / constrained time), in percent (tokens/s drop)."""
    ratios = [m / c for m, c in zip(seconds["matched"], seconds["constrained"], strict=True)]
    return round(100 * (1 - statistics.median(ratios)), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="as --m (default: the embedded SmolLM2 GGUF)")
    ap.add_argument("--unconstrained", type=int, default=8)
    ap.add_argument("--constrained", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48, help="output length of each unconstrained request")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", default=None, help="also write the result here")
    args = ap.parse_args()

    llm = LLM(model=args.model, max_num_seqs=args.unconstrained + args.constrained, seed=0)
    grammars = llm.engine.runner.grammars
    assert grammars is not None
    mask_s = [0.0]
    token_mask, advance = grammars.token_mask, grammars.advance

    def timed(fn):  # time spent on grammar work (masks, matcher advance, mask application in the sampler)
        def wrapper(*a):
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                mask_s[0] += time.perf_counter() - t
        return wrapper

    grammars.token_mask, grammars.advance = timed(token_mask), timed(advance)  # type: ignore[method-assign]
    sampler_module.apply_token_mask = timed(sampler_module.apply_token_mask)
    plain = [(chat_ids(llm, f"Tell me a story about a dragon number {i}."),
              SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, ignore_eos=True))
             for i in range(args.unconstrained)]
    so = StructuredOutputParams(json_schema=SCHEMA)
    asks = [chat_ids(llm, f"Describe person number {i} as JSON with name, age, color, hobbies and a bio.")
            for i in range(args.constrained)]
    constrained = [(ids, SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=256, structured_output=so))
                   for i, ids in enumerate(asks)]
    run(llm, plain[:2], constrained[:2])  # warm-up: grammar compile, llguidance tokenizer, kernels
    lengths = run(llm, [], constrained)[3]
    matched = [(ids, SamplingParams(temperature=1.0, seed=1000 + i, max_tokens=lengths[f"comp{i}"], ignore_eos=True))
               for i, ids in enumerate(asks)]
    n_plain = args.unconstrained * args.max_tokens
    wall: dict[str, list[float]] = {"alone": [], "matched": [], "constrained": []}
    cpu: dict[str, list[float]] = {"alone": [], "matched": [], "constrained": []}
    mask_share: list[float] = []
    for _ in range(args.repeats):
        for name, companions in (("alone", []), ("matched", matched), ("constrained", constrained)):
            mask_s[0] = 0.0
            t_wall, t_cpu, t_all, got = run(llm, plain, companions)
            wall[name].append(t_wall)
            cpu[name].append(t_cpu)
            if name == "constrained":
                mask_share.append(mask_s[0] / t_all)
                assert all(got[f"comp{i}"] == lengths[f"comp{i}"] for i in range(args.constrained)), \
                    "seeded constrained runs must repeat exactly (same batches in every run)"
    best = {k: n_plain / min(v) for k, v in wall.items()}
    by_cpu = {k: n_plain / statistics.median(v) for k, v in cpu.items()}
    result = {
        "model": llm.engine.info.model_name, "device": str(llm.engine.info.device),
        "unconstrained_requests": args.unconstrained, "constrained_requests": args.constrained,
        "unconstrained_tokens_each": args.max_tokens,
        "constrained_tokens_mean": round(statistics.mean(lengths.values()), 1),
        "unconstrained_tok_s_fastest_run": {k: round(v, 1) for k, v in best.items()},
        "unconstrained_tok_per_cpu_s_median": {k: round(v, 1) for k, v in by_cpu.items()},
        "wall_s": {k: [round(x, 2) for x in v] for k, v in wall.items()},
        "cpu_s": {k: [round(x, 2) for x in v] for k, v in cpu.items()},
        "drop_pct_paired_wall": paired_drop(wall),
        "drop_pct_paired_cpu": paired_drop(cpu),
        "drop_pct_fastest_runs": round(100 * (1 - best["constrained"] / best["matched"]), 2),
        "grammar_work_share_pct": round(100 * statistics.median(mask_share), 2),
        "threads": torch.get_num_threads(), "machine": platform.processor() or platform.machine(),
    }
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
