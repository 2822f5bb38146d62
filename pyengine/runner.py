"""The model runner: turns a scheduler ``StepPlan`` into device tensors, runs the model once, and samples.

It is the only part of the engine that touches the model and the KV-cache tensors, and it runs on the
executor's worker thread. It keeps, per request, its own record of the tokens it sampled and the seeded
generator, dropped when a plan reports the request finished. That record lets it run a plan made before the
previous step's tokens reached the scheduler (the scheduler one step ahead): placeholder inputs (-1) are the
request's tokens sampled here, and penalties see every sampled token without reading scheduler state.

Structured output: ``grammars`` (when given) holds a matcher per constrained request; the runner asks it for
the masks of a step's constrained rows before sampling and feeds it the sampled tokens right after, so each
mask comes from a matcher that has seen every earlier token of its row (see ``structured_output.matchers``).

On CUDA, pure-decode steps replay a captured graph (``cuda_graphs.DecodeGraphs``, enabled by
:meth:`ModelRunner.enable_cuda_graphs`); every other step runs the model eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from candle_vllm.pyengine.cuda_graphs import DecodeGraphs, unsupported_reason
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.outputs import TokenLogprobs
from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.sampling import (
    Sampler,
    SamplingBatch,
    SamplingParams,
    SamplingRow,
    make_generator,
    prompt_logprobs,
)
from candle_vllm.pyengine.scheduler.plan import StepPlan
from candle_vllm.pyengine.structured_output import GrammarMatchers

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepResult:
    """What one step produced, in ``plan.sampled_requests`` order, plus prompt logprobs of prefill chunks."""

    step_id: int
    sampled_token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)


class ModelRunner:
    """Runs steps of one model on one device over its paged KV cache."""

    def __init__(
        self,
        model: nn.Module,
        kv_caches: list[torch.Tensor],
        vocab_size: int,
        device: torch.device,
        eos_token_ids: Collection[int] = (),
        seed: int | None = None,
        grammars: GrammarMatchers | None = None,
    ) -> None:
        self.model = model
        self.model.kv_caches = kv_caches
        self.vocab_size = vocab_size
        self.device = device
        self.eos_token_ids = tuple(eos_token_ids)
        shared = torch.Generator(device=device)
        if seed is not None:
            shared.manual_seed(seed)
        else:
            shared.seed()
        self.sampler = Sampler(shared)
        self._generators: dict[str, torch.Generator] = {}
        self._sampled: dict[str, list[int]] = {}  # request id -> every token sampled for it, in order
        self.graphs: DecodeGraphs | None = None
        self.grammars = grammars

    def enable_cuda_graphs(self, max_num_seqs: int, max_model_len: int, block_size: int) -> bool:
        """Capture decode graphs for batch sizes up to ``max_num_seqs`` (capped at 256) and contexts up to
        ``max_model_len`` (at most ``cuda_graphs.MAX_CAPTURED_CONTEXT``); returns False (and logs why) when this
        model, cache or device cannot use them."""
        reason = unsupported_reason(self.model, self.model.kv_caches, self.device)
        if reason is not None:
            log.info("CUDA graphs off: %s", reason)
            return False
        graphs = DecodeGraphs(self.model, self.device, max_num_seqs, max_model_len, block_size)
        try:
            graphs.capture()
        except RuntimeError as exc:  # an op of this model that cannot be captured: serve it eagerly instead
            log.warning("CUDA graphs off: capturing the decode step failed (%s); pass --disable-cuda-graph to "
                        "skip the attempt", exc)
            return False
        self.graphs = graphs
        return True

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one planned step and sample the requests whose known tokens it completes."""
        for request_id in plan.finished_ids:
            self._generators.pop(request_id, None)
            self._sampled.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(plan.finished_ids)
            if plan.new_request_ids:
                new_ids = set(plan.new_request_ids)
                self.grammars.admit(req for req in plan.requests if req.request_id in new_ids)
        if plan.is_empty:
            return StepResult(plan.step_id, [], [])
        input_ids = self._fill_placeholders(plan)
        result = StepResult(plan.step_id, [], [])
        with torch.inference_mode():
            bucket = self._graph_bucket(plan)
            if bucket is not None:
                assert self.graphs is not None
                hidden, logits = self.graphs.run(bucket, input_ids, plan.positions, plan.slot_mapping, plan.seq_lens,
                                                 plan.block_tables)
                if not np.array_equal(plan.sample_indices, np.arange(plan.num_tokens)):
                    logits = logits[self._tensor(plan.sample_indices, torch.int64)]
                self._sample(plan.sampled_requests, logits, result)
            else:
                ids, pos = self._tensor(input_ids, torch.int64), self._tensor(plan.positions, torch.int64)
                if self._sampled_rows_only(plan):
                    # The model's last layer runs for the sampled rows alone: hidden holds just those rows.
                    rows = self._tensor(plan.sample_indices, torch.int64)
                    hidden = self.model(ids, pos, self._attention_metadata(plan), output_rows=rows)
                    self._sample(plan.sampled_requests, self.model.compute_logits(hidden), result)
                    return result
                hidden = self.model(ids, pos, self._attention_metadata(plan))
                if plan.sampled_requests:
                    logits = self.model.compute_logits(hidden[self._tensor(plan.sample_indices, torch.int64)])
                    self._sample(plan.sampled_requests, logits, result)
            self._prompt_logprobs(plan, hidden, result)
        return result

    def _sampled_rows_only(self, plan: StepPlan) -> bool:
        """Whether the model need only produce the sampled rows' hidden states: it supports that, some but not all
        rows are sampled, and no request wants prompt logprobs (they read every prompt row's state)."""
        return (
            getattr(self.model, "supports_output_rows", False)
            and 0 < len(plan.sampled_requests) < plan.num_tokens
            and all(req.sampling_params.prompt_logprobs is None for req in plan.requests)  # type: ignore[union-attr]
        )

    def _graph_bucket(self, plan: StepPlan) -> int | None:
        """The decode graph for this step: every request runs one new token and is sampled."""
        if self.graphs is None or not (plan.num_tokens == len(plan.requests) == len(plan.sampled_requests)):
            return None
        return self.graphs.bucket_for(plan.num_tokens, int(plan.seq_lens.max()), plan.block_tables.shape[1])

    def _fill_placeholders(self, plan: StepPlan) -> np.ndarray:
        """Input ids with each placeholder (-1: sampled by a step whose result the scheduler has not applied)
        replaced by the token this runner sampled for that position."""
        holes = np.flatnonzero(plan.input_ids < 0)
        if holes.size == 0:
            return plan.input_ids
        ids = plan.input_ids.copy()
        row_of = np.searchsorted(plan.query_start_loc, holes, side="right") - 1
        for hole, row in zip(holes.tolist(), row_of.tolist(), strict=True):
            req = plan.requests[row]
            ids[hole] = self._sampled[req.request_id][int(plan.positions[hole]) - req.num_prompt_tokens]
        return ids

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(array)
        if t.dtype != dtype:
            t = t.to(dtype)
        return t.to(self.device, non_blocking=True)

    def _attention_metadata(self, plan: StepPlan) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._tensor(plan.query_start_loc, torch.int32),
            seq_lens=self._tensor(plan.seq_lens, torch.int32),
            slot_mapping=self._tensor(plan.slot_mapping, torch.int64),
            block_tables=self._tensor(plan.block_tables, torch.int32),
            query_start_loc_cpu=plan.query_start_loc.tolist(),
            seq_lens_cpu=plan.seq_lens.tolist(),
        )

    def _sample(self, requests: list[Request], logits: torch.Tensor, result: StepResult) -> None:
        histories = [self._sampled.setdefault(req.request_id, []) for req in requests]
        rows = [
            SamplingRow(req.sampling_params, history, req.prompt_token_ids, self._generator(req))
            for req, history in zip(requests, histories, strict=True)
        ]
        masked = self.grammars.token_mask(requests) if self.grammars is not None else None
        batch = SamplingBatch.build(rows, self.vocab_size, self.device, self.eos_token_ids,
                                    token_mask=masked[1] if masked else None)
        out = self.sampler(logits, batch)
        result.sampled_token_ids = out.sampled_token_ids.tolist()
        if masked:
            self.grammars.advance(requests, masked[0], result.sampled_token_ids)  # type: ignore[union-attr]
        for history, token in zip(histories, result.sampled_token_ids, strict=True):
            history.append(token)
        if out.logprobs is None:
            result.logprobs = [None] * len(requests)
        else:
            result.logprobs = out.logprobs.tolists(batch.num_logprobs)

    def _generator(self, req: Request) -> torch.Generator | None:
        params: SamplingParams = req.sampling_params  # type: ignore[assignment]
        if params.seed is None or params.is_greedy:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = make_generator(params.seed, self.device)
        return gen

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, result: StepResult) -> None:
        """Logprobs of the prompt tokens this step computed, for requests that asked for them."""
        qsl = plan.query_start_loc
        for i, req in enumerate(plan.requests):
            params: SamplingParams = req.sampling_params  # type: ignore[assignment]
            start = plan.start_positions[i]
            if params.prompt_logprobs is None or start >= req.num_prompt_tokens:
                continue
            # Row j (position start + j) predicts prompt token start + j + 1 while that is still a prompt token.
            n_rows = min(plan.num_new_tokens[i], req.num_prompt_tokens - 1 - start)
            entries: list[TokenLogprobs | None] = [None] if start == 0 else []
            if n_rows > 0:
                first = int(qsl[i])
                logits = self.model.compute_logits(hidden[first : first + n_rows])
                targets = torch.tensor(req.prompt_token_ids[start + 1 : start + 1 + n_rows], device=self.device)
                lp = prompt_logprobs(logits, targets, params.prompt_logprobs)
                entries.extend(lp.tolists([params.prompt_logprobs] * n_rows))
            result.prompt_logprobs[req.request_id] = entries
