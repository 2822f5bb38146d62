"""Serving benchmark with vLLM's ``bench serve`` logic, against candle-vllm's OpenAI API.

Each request streams ``/v1/completions`` with ``stream_options.include_usage`` and ``ignore_eos``; TTFT is taken
at the first chunk with non-empty ``choices``, ITL between such chunks, output tokens from the usage chunk,
TPOT = (latency - TTFT) / (output tokens - 1). ``--compare-offline`` runs the same prompts through the offline
``LLM`` at the same batch size and reports server / offline output throughput.

    python benches/bench_serving.py --concurrency 64 --num-prompts 128 --input-len 64 --output-len 32 \\
        --compare-offline
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
import trio


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


async def one_request(client: httpx2.AsyncClient, model: str, prompt: list[int], output_len: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    start = time.perf_counter()
    last = start
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = (await resp.aread()).decode()[:200]
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                now = time.perf_counter()
                if chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                if chunk.get("usage"):
                    res.output_tokens = chunk["usage"]["completion_tokens"]
        res.latency = time.perf_counter() - start
        res.ok = res.output_tokens > 0
    except httpx2.HTTPError as exc:
        res.error = repr(exc)
    return res


async def run_load(base_url: str, prompts: list[list[int]], output_len: int, concurrency: int) -> tuple[list[RequestResult], float]:
    limits = httpx2.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx2.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        await one_request(client, model, prompts[0], 2)  # warm-up (and readiness)
        results: list[RequestResult] = [RequestResult() for _ in prompts]
        limiter = trio.Semaphore(concurrency)

        async def worker(i: int) -> None:
            async with limiter:
                results[i] = await one_request(client, model, prompts[i], output_len)

        start = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(len(prompts)):
                nursery.start_soon(worker, i)
        return results, time.perf_counter() - start


def _pcts(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0}
    ordered = sorted(values)
    return {"mean": statistics.fmean(values) * 1e3, "median": statistics.median(values) * 1e3,
            "p99": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] * 1e3}


def summarize(results: list[RequestResult], duration: float, input_len: int) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (out_tokens + input_len * len(ok)) / duration,
        "ttft_ms": _pcts([r.ttft for r in ok]), "tpot_ms": _pcts(tpot),
        "itl_ms": _pcts([x for r in ok for x in r.itl]),
    }


def start_server(engine_flags: list[str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "candle_vllm", "--h", "127.0.0.1", "--p", "0", *engine_flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        found = re.search(r"API: (http://\S+)/v1", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError("the server exited before listening")


def offline_throughput(model: str | None, prompts: list[list[int]], output_len: int, concurrency: int,
                       engine_kwargs: dict[str, Any]) -> float:
    """Output tokens/s of the offline engine on the same prompts, batch size = the server's concurrency."""
    from candle_vllm.pyengine.llm import LLM
    from candle_vllm.pyengine.sampling import SamplingParams

    llm = LLM(model=model, max_num_seqs=concurrency, **engine_kwargs)
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=2), use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    duration = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / duration


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", help="a running server (default: start one with --m/--mem)")
    ap.add_argument("--m", dest="model", help="model for the started server and the offline run (default: embedded)")
    ap.add_argument("--mem", type=int, default=512, help="KV cache MB for the started server / offline engine")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--compare-offline", action="store_true")
    args = ap.parse_args()

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    engine_flags = ["--mem", str(args.mem), "--max-num-seqs", str(args.concurrency)]
    if args.model:
        engine_flags += ["--m", args.model]
    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = start_server(engine_flags)
    try:
        results, duration = trio.run(run_load, base_url, prompts, args.output_len, args.concurrency)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
    report = summarize(results, duration, args.input_len)
    report["config"] = {k: v for k, v in vars(args).items() if k != "base_url"}
    if args.compare_offline:
        offline = offline_throughput(args.model, prompts, args.output_len, args.concurrency, {"mem": args.mem})
        report["offline_output_throughput"] = offline
        report["server_over_offline"] = report["output_throughput"] / offline
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
