"""The engine core: model, KV cache, scheduler, runner and output processor wired from ``EngineArgs``.

The offline ``LLM`` drives it with ``step()`` until done, keeping up to ``PIPELINE_DEPTH`` steps launched on the
device; the serving actors call the same stages (``schedule``, ``runner.launch``/``collect``, ``apply``,
``process``) from different tasks so they overlap.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import deque
from dataclasses import dataclass

import torch

from candle_vllm.pyengine.config import ModelConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.kv_cache import (
    allocate_kv_caches,
    kv_bytes_per_token,
    kv_cache_budget_bytes,
    num_kv_blocks,
)
from candle_vllm.pyengine.kv_cache.turbo import K_BITS, turbo_format
from candle_vllm.pyengine.loader import load_model, resolve_model_source
from candle_vllm.pyengine.loader.embedded import default_model_path
from candle_vllm.pyengine.loader.pooling import check_last_token_pooling
from candle_vllm.pyengine.output_processor import OutputProcessor, RequestGroup, StopStringHit, TokenEvent
from candle_vllm.pyengine.outputs import PromptLogprobsChunk, RequestOutput
from candle_vllm.pyengine.request import FinishReason, Request
from candle_vllm.pyengine.runner import ModelRunner, PendingStep, StepResult
from candle_vllm.pyengine.sampling import SamplingDefaults, SamplingParams
from candle_vllm.pyengine.sampling.bad_words import bad_words_token_ids
from candle_vllm.pyengine.sampling.params import truncate_prompt
from candle_vllm.pyengine.scheduler import Scheduler, SchedulerConfig
from candle_vllm.pyengine.scheduler.config import default_max_tokens
from candle_vllm.pyengine.scheduler.plan import StepPlan
from candle_vllm.pyengine.structured_output import GrammarMatchers, check_structured_output, compiler_for
from candle_vllm.pyengine.tokenizer import Tokenizer

log = logging.getLogger(__name__)
PIPELINE_DEPTH = 2  # steps launched on the device before the oldest one is read back and applied


@dataclass(slots=True)
class StepEvents:
    """A step's results as the output processor needs them, detached from scheduler state."""

    events: list[TokenEvent]
    prompt_logprobs: dict[str, PromptLogprobsChunk]
    embeddings: dict[str, list[float]]


@dataclass(frozen=True)
class EngineInfo:
    """Facts for start-up summaries, /v1/models and metrics."""

    model_name: str
    device: torch.device
    dtype: torch.dtype
    quantization: str
    max_model_len: int
    num_blocks: int
    block_size: int
    kv_cache_dtype: torch.dtype  # the activation dtype, float8_e4m3fn with fp8, uint8 rows with the turbo modes
    kv_cache_mode: str = "auto"  # --kvcache-dtype, canonical

    @property
    def kv_cache_label(self) -> str:
        """What the cache holds, for people: the element type, or the TurboQuant mode."""
        return self.kv_cache_mode if self.kv_cache_mode in K_BITS else str(self.kv_cache_dtype).removeprefix("torch.")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size


class EngineCore:
    """Owns the engine's state; not thread-safe: one task (or the offline loop) drives it."""

    def __init__(self, args: EngineArgs) -> None:
        device = args.resolve_device()
        default_kv_budget = args.kv_fraction is None and args.mem is None
        for note in args.unused_flag_notes():
            log.warning(note)
        args = args.resolved(device)
        if device.type == "cuda":
            # cuBLASLt's heuristics pick faster kernels than cuBLAS's for the decode-batch linears (M = 17..64) on
            # the H200: batch-64 decode 9,392 vs 9,148 tok/s in one call, prefill unchanged (benches/RESULTS.md).
            # A process-wide torch setting, made before any GEMM runs or is captured in a CUDA graph.
            torch.backends.cuda.preferred_blas_library("cublaslt")
        self.args = args
        dtype = args.torch_dtype(device)
        cache_dtype = args.cache_torch_dtype(device, dtype)  # refused before the model loads, not after
        model_arg = args.model
        embedded = model_arg is None and args.weight_path is None and args.weight_file is None
        if embedded:
            model_arg = str(default_model_path())
        source = resolve_model_source(model_arg, args.weight_path, args.weight_file, args.hf_token_value(),
                                      args.load_format)
        loaded = load_model(source, dtype, device, args.load_format, args.yarn_scaling_factor, args.isq,
                            args.hf_overrides)
        if loaded.tokenizer is None:
            raise ValueError(f"{source.name}: no tokenizer found next to the weights (tokenizer.json or GGUF vocab)")
        self.tokenizer: Tokenizer = loaded.tokenizer
        self.model_config: ModelConfig = loaded.config
        self.pooling = loaded.pooling
        self.matryoshka = loaded.matryoshka
        self.embedding_only = loaded.embedding_only
        cfg = loaded.config
        max_model_len = cfg.max_position_embeddings
        if args.max_model_len is not None:
            if args.max_model_len > max_model_len:
                log.warning("--max-model-len %d is beyond the model's context (%d tokens); serving %d (extend the "
                            "context with --yarn-scaling-factor)", args.max_model_len, max_model_len, max_model_len)
            max_model_len = min(args.max_model_len, max_model_len)
        self.max_model_len = max_model_len

        assert args.block_size is not None
        turbo = turbo_format(args.kvcache_dtype, cfg.head_dim)
        per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cache_dtype, turbo)
        budget = kv_cache_budget_bytes(device, args.kv_fraction, args.mem, cap_cpu=default_kv_budget)
        num_blocks = num_kv_blocks(budget, args.block_size, per_token)
        caches = allocate_kv_caches(cfg.num_layers, num_blocks, args.block_size, cfg.num_kv_heads, cfg.head_dim,
                                    cache_dtype, device, turbo)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=args.block_size, max_model_len=max_model_len,
            max_num_seqs=args.max_num_seqs, prefill_chunk_size=args.prefill_chunk_size,
            enable_prefix_caching=not args.disable_prefix_cache,
            prefix_cache_max_tokens=args.prefix_cache_max_tokens, scheduling_policy=args.scheduling_policy,
        ))
        self.runner = ModelRunner(loaded.model, caches, cfg.vocab_size, device, self.tokenizer.stop_token_ids,
                                  seed=args.seed, grammars=GrammarMatchers(compiler_for(self.tokenizer)))
        if device.type == "cuda" and not args.disable_cuda_graph:
            self.runner.enable_cuda_graphs(args.max_num_seqs, max_model_len, args.block_size)
        self.outputs = OutputProcessor(self.tokenizer)
        self.sampling_defaults = SamplingDefaults.from_generation_config(loaded.generation_config).overridden_by(
            SamplingDefaults(**args.sampling_defaults()))
        self.max_gen_tokens = args.max_gen_tokens_for(max_model_len)
        self._in_flight: deque[tuple[StepPlan, PendingStep]] = deque()  # launched by step(), not yet applied
        self.info = EngineInfo(
            model_name=default_model_path().stem if embedded else source.name, device=device, dtype=dtype, quantization=_quantization(source.format, loaded),
            max_model_len=max_model_len, num_blocks=num_blocks, block_size=args.block_size, kv_cache_dtype=cache_dtype,
            kv_cache_mode=args.kvcache_dtype,
        )

    # ---- requests --------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> None:
        """Queue a user request (``n`` engine requests sharing the prompt; ``priority`` as vLLM's, under the
        priority scheduling policy). Raises ``RequestRejected`` or ``ValueError`` when it can never run, before
        any state changes."""
        prompt_token_ids, params = self.prepare(prompt_token_ids, params)
        group = RequestGroup(request_id, prompt, list(prompt_token_ids), params)
        requests: list[Request] = []
        for index in range(params.n):
            child = params if params.seed is None or index == 0 else dataclasses.replace(params, seed=params.seed + index)
            requests.append(Request(
                f"{request_id}#{index}" if params.n > 1 else request_id, group.prompt_token_ids, child,
                eos_token_ids=self.tokenizer.stop_token_ids,
                fork_of=requests[0].request_id if index > 0 else None, priority=priority,
            ))
        added: list[Request] = []
        try:
            for req in requests:
                self.scheduler.add_request(req)
                added.append(req)
            self.outputs.add(group, requests)
        except Exception:
            for req in added:
                self.scheduler.abort(req.request_id)
            raise

    def prepare(self, prompt_token_ids: list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt as it runs (cut to ``truncate_prompt_tokens`` first, so the default ``max_tokens`` fits what
        is left, then its ids checked) and its resolved params; a ValueError when it can never run. Idempotent:
        the async intake prepares a request, and ``add_request`` prepares it again."""
        ids = truncate_prompt(prompt_token_ids, params.truncate_prompt_tokens, self.max_model_len)
        self.check_prompt_ids(ids)
        return ids, self.resolve_params(params, len(ids))

    def check_prompt_ids(self, prompt_token_ids: list[int]) -> None:
        """Every id must name a token the model embeds and the tokenizer decodes: an id past either would fail
        the whole step it runs in (taking its batch-mates with it), a negative one the detokenizer."""
        size = min(self.model_config.vocab_size, self.tokenizer.vocab_size)
        bad = [t for t in prompt_token_ids if not 0 <= t < size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (ids 0..{size - 1})")

    def resolve_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Server defaults for unset fields, the output cap, and vocabulary checks. An unset ``max_tokens`` takes
        ``--max-gen-tokens`` cut to what fits after a prompt of ``prompt_len`` tokens (``default_max_tokens``, the
        server's rule too)."""
        params = self.sampling_defaults.apply(params)
        if params.bad_words and params.bad_words_token_ids is None:
            ids = bad_words_token_ids(params.bad_words, self.tokenizer)
            params = dataclasses.replace(params, bad_words_token_ids=ids)
        params.check_vocab(self.model_config.vocab_size)
        if params.embed:
            check_last_token_pooling(self.pooling)
        elif self.embedding_only:
            raise ValueError("this checkpoint ships no LM head (a base model saved for its embeddings): it serves "
                             "embeddings only (/v1/embeddings, LLM.embed), not generation")
        if params.structured_output is not None:  # a bad schema fails here, not inside a step
            check_structured_output(params.structured_output, self.tokenizer)
        if params.max_tokens is None:
            cfg = self.scheduler.config
            limit = default_max_tokens(self.max_gen_tokens, prompt_len, cfg.max_model_len, cfg.num_blocks * cfg.block_size)
            params = dataclasses.replace(params, max_tokens=limit)
        return params

    def abort(self, request_id: str) -> RequestOutput | None:
        """Cancel a user request: its engine requests free their blocks; returns its final output."""
        for engine_id in self.outputs.engine_request_ids(request_id):
            self.scheduler.abort(engine_id)
        return self.outputs.abort(request_id)

    def has_unfinished(self) -> bool:
        """Requests to run or outputs to deliver. A launched step whose requests all ended meanwhile does not
        count: the next ``step()`` reads it back and drops its tokens."""
        return self.scheduler.has_unfinished_requests() or bool(self.outputs.groups)

    # ---- stages of a step ------------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        return self.scheduler.schedule()

    def apply(self, plan: StepPlan, result: StepResult) -> StepEvents:
        """Apply a step's samples to the scheduler; returns the tokens kept, with the finish state each left
        its request in (tokens of requests that ended while the step ran are dropped)."""
        sampled = plan.sampled_requests
        alive = [not req.is_finished for req in sampled]
        self.scheduler.update(plan, result.sampled_token_ids)
        events = [
            TokenEvent(req.request_id, tok, req.finish_reason.value if req.is_finished and req.finish_reason else None,
                       req.stop_reason if isinstance(req.stop_reason, int) else None, lp, req.num_cached_tokens,
                       req.first_scheduled_time)
            for req, tok, lp, ok in zip(sampled, result.sampled_token_ids, result.logprobs, alive, strict=True)
            if ok
        ]
        return StepEvents(events, result.prompt_logprobs, result.embeddings)

    def process(self, step: StepEvents) -> tuple[list[RequestOutput], list[StopStringHit]]:
        """Detokenize and match stop strings; the caller ends the hit requests with ``finish_stop``."""
        for engine_id, chunk in step.prompt_logprobs.items():
            self.outputs.add_prompt_logprobs(engine_id, chunk)
        for engine_id, vector in step.embeddings.items():
            self.outputs.add_embedding(engine_id, vector)
        return self.outputs.process(step.events)

    def finish_stop(self, hits: list[StopStringHit]) -> None:
        for hit in hits:
            self.scheduler.finish(hit.request_id, FinishReason.STOP, hit.stop)

    def step(self) -> list[RequestOutput]:
        """Finish one step: first plan and launch steps until ``PIPELINE_DEPTH`` are on the device (the newest
        planned before the older ones' tokens are applied; the runner fills their placeholders on the device),
        then read back, apply and process the oldest. The host's work for step N thus runs while the device
        computes step N+1."""
        in_flight = self._in_flight
        while len(in_flight) < PIPELINE_DEPTH and self.scheduler.has_unfinished_requests():
            plan = self.schedule()
            pending = self.runner.launch(plan)  # an empty plan still tells the runner which requests ended
            if plan.is_empty:  # every request waits on an in-flight result
                break
            in_flight.append((plan, pending))
        if not in_flight:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("the scheduler has unfinished requests but planned nothing")
            return []
        plan, pending = in_flight.popleft()
        try:
            result = self.runner.collect(pending)
        except Exception:
            self._fail_in_flight(plan)
            raise
        outputs, hits = self.process(self.apply(plan, result))
        self.finish_stop(hits)
        return outputs

    def _fail_in_flight(self, failed: StepPlan) -> None:
        """A step raised: abort its requests and those of every step launched after it (they read tokens the
        failed step never sampled), reading those steps back first, so the engine is usable again."""
        plans = [failed]
        while self._in_flight:
            plan, pending = self._in_flight.popleft()
            with contextlib.suppress(Exception):
                self.runner.collect(pending)
            plans.append(plan)
        groups = {self.outputs.group_id(req.request_id) for plan in plans for req in plan.requests}
        for group in groups:
            if group is not None:
                self.abort(group)


def _quantization(fmt: str, loaded: object) -> str:
    if fmt != "gguf":
        return "none"
    file_type = getattr(loaded.config, "extra", {}).get("gguf_file_type")  # type: ignore[attr-defined]
    return f"gguf{'' if file_type is None else f' ({file_type})'}"
