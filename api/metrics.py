"""Prometheus metrics under vLLM's names, so dashboards and ``vllm`` tests built for vLLM read ours unchanged.

Scheduler gauges are read from ``engine.stats()`` when ``/metrics`` is scraped; per-request histograms are fed
by :class:`RequestTracker` from the outputs the HTTP layer already receives (no extra engine hooks).
"""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from candle_vllm.pyengine.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0)
_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


def _token_buckets(max_model_len: int) -> list[float]:
    """1-2-5 buckets up to the context length, as vLLM sizes its token-count histograms."""
    out: list[float] = []
    base = 1
    while True:
        for m in (1, 2, 5):
            if base * m > max_model_len:
                return out
            out.append(float(base * m))
        base *= 10


class ServerMetrics:
    """The registry of one server (a private registry, so several servers in one process don't clash)."""

    def __init__(self, model_name: str, max_model_len: int) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name

        def hist(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 1 means full.", labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated.", labels, registry=r)
        self.success = Counter("vllm:request_success", "Finished requests.", [*labels, "finished_reason"],
                               registry=r)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between output tokens.", _ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS)
        self.queue = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.prefill = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.",
                            _LATENCY_BUCKETS)
        self.decode = hist("vllm:request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        tokens = _token_buckets(max_model_len)
        self.req_prompt = hist("vllm:request_prompt_tokens", "Prompt tokens per request.", tokens)
        self.req_generation = hist("vllm:request_generation_tokens", "Generated tokens per request.", tokens)

    def render(self, engine_stats: Any) -> bytes:
        """The text exposition, with the scheduler gauges refreshed from ``engine_stats`` first."""
        m = self.model_name
        self.running.labels(m).set(engine_stats.num_running)
        self.waiting.labels(m).set(engine_stats.num_waiting)
        self.kv_usage.labels(m).set(engine_stats.kv_usage)
        return generate_latest(self.registry)


class RequestTracker:
    """Turns the successive outputs of one request into histogram observations."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self._m = metrics
        self._last_token_at: float | None = None
        self._done = False

    def observe(self, out: RequestOutput) -> None:
        """Account one engine output (cumulative state with deltas since the previous one)."""
        now = time.monotonic()
        m, name = self._m, self._m.model_name
        new = max((len(c.token_ids_delta) for c in out.outputs), default=0)
        if new:
            at = out.metrics.last_token_time or now
            if self._last_token_at is None:
                arrival = out.metrics.arrival_time
                first = out.metrics.first_token_time or at
                m.ttft.labels(name).observe(max(0.0, first - arrival))
                new -= 1
            if new and self._last_token_at is not None:
                gap = max(0.0, at - self._last_token_at) / new
                for _ in range(new):
                    m.itl.labels(name).observe(gap)
            self._last_token_at = at
        if out.finished:
            reasons = [c.finish_reason or "abort" for c in out.outputs]
            self.finish(out, reasons[0] if reasons else "abort")

    def finish(self, out: RequestOutput | None, reason: str) -> None:
        """Record the end of the request once (finished by the engine, or aborted by the server)."""
        if self._done:
            return
        self._done = True
        m, name = self._m, self._m.model_name
        m.success.labels(name, reason).inc()
        if out is None:
            return
        generated = sum(len(c.token_ids) for c in out.outputs)
        embedding = out.embedding is not None  # a pooling request: no generation to count, no decode phase
        m.prompt_tokens.labels(name).inc(len(out.prompt_token_ids))
        m.generation_tokens.labels(name).inc(generated)
        m.req_prompt.labels(name).observe(len(out.prompt_token_ids))
        if not embedding:
            m.req_generation.labels(name).observe(generated)
        t = out.metrics
        end = t.finished_time or time.monotonic()
        m.e2e.labels(name).observe(max(0.0, end - t.arrival_time))
        if t.first_scheduled_time is not None:
            m.queue.labels(name).observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.first_token_time is not None:
                m.prefill.labels(name).observe(max(0.0, t.first_token_time - t.first_scheduled_time))
        if t.first_token_time is not None and not embedding:
            m.decode.labels(name).observe(max(0.0, end - t.first_token_time))
