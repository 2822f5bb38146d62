"""The model runner: turns a scheduler ``StepPlan`` into device tensors, runs the model once, and samples.

It is the only part of the engine that touches the model and the KV-cache tensors, and it runs on the
executor's worker thread. It keeps, per request, its own record of the tokens it sampled and the seeded
generator, dropped when a plan reports the request finished. That record lets it run a plan made before the
previous step's tokens reached the scheduler (the scheduler one step ahead): placeholder inputs (-1) are the
request's tokens sampled here, and penalties see every sampled token without reading scheduler state.

A step is two calls so the device never waits for the host between steps: :meth:`ModelRunner.launch` queues
all of a step's device work (inputs, model, sampling, a non-blocking copy of the sampled ids to pinned host
memory) and returns a :class:`PendingStep`; :meth:`ModelRunner.collect` waits for it and reads the ids back.
Step N+1 may be launched before step N is collected: its placeholders for tokens step N samples are then
gathered on the device from step N's sampled-ids tensor (see ``step_inputs.placeholder_sources``).
:meth:`ModelRunner.execute` is launch and collect at once.

Launch collects the pending steps first (the serial order of old) when the new step needs host-side state
of a step still in flight (``_needs_host_state``):
- the pending step has grammar rows: each matcher must consume its token before it yields the next mask;
- a row of the new step reads its sampled history and that history's newest token is in flight: penalties
  (repetition/frequency/presence count the tokens), bad words of several tokens (their bans depend on the last
  tokens) and
  min_tokens while it still bans stop tokens (the ban depends on how many tokens the row has);
- a placeholder whose token is neither on the host nor in the last launched step.

Structured output: ``grammars`` (when given) holds a matcher per constrained request; the runner asks it for
the masks of a step's constrained rows before sampling and feeds it the sampled tokens when the step is
collected, so each mask comes from a matcher that has seen every earlier token of its row.

On CUDA, pure-decode steps replay a captured graph (``cuda_graphs.DecodeGraphs``, enabled by
:meth:`ModelRunner.enable_cuda_graphs`); every other step runs the model eagerly.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Collection

import numpy as np
import torch

from candle_vllm.pyengine.cuda_graphs import DecodeGraphs, unsupported_reason
from candle_vllm.pyengine.models.base import CausalLM
from candle_vllm.pyengine.ops.attention import AttentionMetadata
from candle_vllm.pyengine.ops.transfer import to_device
from candle_vllm.pyengine.outputs import PromptLogprobsChunk, TokenLogprobs
from candle_vllm.pyengine.request import Request
from candle_vllm.pyengine.runner_steps import PendingStep, PipelineStats, StepResult, placeholder_sources
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

__all__ = ["ModelRunner", "PendingStep", "PipelineStats", "StepResult"]

log = logging.getLogger(__name__)


class ModelRunner:
    """Runs steps of one model on one device over its paged KV cache."""

    def __init__(
        self,
        model: CausalLM,
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
        self._sampled: dict[str, list[int]] = {}  # request id -> every collected token sampled for it, in order
        self._pending: deque[PendingStep] = deque()  # launched, not yet read back, in launch order
        self.graphs: DecodeGraphs | None = None
        self.grammars = grammars
        self.stats = PipelineStats()

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

    # ---- the step pipeline -------------------------------------------------------------------------------

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one planned step and sample the requests whose known tokens it completes (launch + collect)."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> PendingStep:
        """Queue one planned step on the device without waiting for it; pass the result to :meth:`collect`.

        Steps must be launched in plan order; an earlier step may still be pending (see the module docstring
        for when launch collects it first)."""
        prev = self._pending[-1] if self._pending else None
        if prev is not None and self._needs_host_state(plan, prev):
            self._collect_all()
            self.stats.serialized += 1
            prev = None
        self._forget_and_admit(plan)
        step = PendingStep(plan)
        if plan.is_empty:
            step.result = StepResult(plan.step_id, [], [])
            return step
        sources = placeholder_sources(plan, self._sampled, prev)
        if sources is None:  # a placeholder token of an older pending step: read everything back first
            self._collect_all()
            self.stats.serialized += 1
            prev = None
            sources = placeholder_sources(plan, self._sampled, None)
            if sources is None:
                raise RuntimeError(f"step {plan.step_id} has a placeholder for a token this runner never sampled")
        host_ids, dst, src = sources
        with torch.inference_mode():
            ids: np.ndarray | torch.Tensor = host_ids
            if dst is not None:
                assert prev is not None and prev.sampled is not None and src is not None
                if _is_identity(dst, host_ids.shape[0]) and _is_identity(src, host_ids.shape[0]):
                    # Every input is the token the previous step sampled in the same row (steady decode): use
                    # its ids as they are, without copies or gather kernels between the two steps.
                    ids = prev.sampled[: host_ids.shape[0]]
                    self.stats.fed_as_sampled += 1
                else:
                    ids = self._tensor(host_ids, torch.int64)
                    ids.index_copy_(0, self._tensor(dst, torch.int64),
                                    prev.sampled.index_select(0, self._tensor(src, torch.int64)))
            self._run_model(plan, ids, step)
        step.start_read_back(self.device)
        self.stats.launched += 1
        if prev is not None:
            self.stats.overlapped += 1
        self._pending.append(step)
        return step

    def collect(self, step: PendingStep) -> StepResult:
        """Wait for a launched step and return what it sampled (earlier pending steps are read back first, so
        every request's history stays in order). Raises the error the step hit, if any."""
        while step.result is None and step.error is None:
            if not self._pending:
                raise RuntimeError(f"step {step.plan.step_id} was not launched by this runner")
            self._read_back(self._pending.popleft())
        if step.error is not None:
            raise step.error
        assert step.result is not None
        return step.result

    def _collect_all(self) -> None:
        while self._pending:
            self._read_back(self._pending.popleft())

    def _needs_host_state(self, plan: StepPlan, prev: PendingStep) -> bool:
        """Whether ``plan`` cannot be launched before ``prev`` is read back (the fallbacks of the module
        docstring; placeholders are checked by ``placeholder_sources``)."""
        if prev.grammar_rows:
            return True
        in_flight = prev.row_of
        for req in plan.sampled_requests:
            if req.request_id not in in_flight:
                continue
            params: SamplingParams = req.sampling_params  # type: ignore[assignment]
            if (params.has_penalties or params.bad_words_need_history
                    or params.min_tokens > len(self._sampled.get(req.request_id, ()))):
                return True
        return False

    def _forget_and_admit(self, plan: StepPlan) -> None:
        """Drop the state of requests that ended; start matchers of newly admitted constrained requests."""
        for request_id in plan.finished_ids:
            self._generators.pop(request_id, None)
            self._sampled.pop(request_id, None)
        if self.grammars is not None:
            self.grammars.release(plan.finished_ids)
            if plan.new_request_ids:
                new_ids = set(plan.new_request_ids)
                self.grammars.admit(req for req in plan.requests if req.request_id in new_ids)

    # ---- one step's device work --------------------------------------------------------------------------

    def _run_model(self, plan: StepPlan, ids: np.ndarray | torch.Tensor, step: PendingStep) -> None:
        bucket = self._graph_bucket(plan)
        if bucket is not None:
            assert self.graphs is not None
            hidden, logits = self.graphs.run(bucket, ids, plan.positions, plan.slot_mapping, plan.seq_lens,
                                             plan.block_tables)
            if not np.array_equal(plan.sample_indices, np.arange(plan.num_tokens)):
                rows = self._tensor(plan.sample_indices, torch.int64)
                hidden, logits = hidden[rows], logits[rows]
            self._sample(plan.sampled_requests, logits, step)
            self._embed(plan.sampled_requests, hidden, step)
            return
        ids_t = ids if isinstance(ids, torch.Tensor) else self._tensor(ids, torch.int64)
        pos = self._tensor(plan.positions, torch.int64)
        if self._sampled_rows_only(plan):
            # The model's last layer runs for the sampled rows alone: hidden holds just those rows.
            rows = self._tensor(plan.sample_indices, torch.int64)
            hidden = self.model(ids_t, pos, self._attention_metadata(plan), output_rows=rows)
            self._sample(plan.sampled_requests, self.model.compute_logits(hidden, f32=False), step)
            self._embed(plan.sampled_requests, hidden, step)
            return
        hidden = self.model(ids_t, pos, self._attention_metadata(plan))
        if plan.sampled_requests:
            sampled = hidden[self._tensor(plan.sample_indices, torch.int64)]
            self._sample(plan.sampled_requests, self.model.compute_logits(sampled, f32=False), step)
            self._embed(plan.sampled_requests, sampled, step)
        self._prompt_logprobs(plan, hidden, step)

    def tracked_requests(self) -> set[str]:
        """Requests whose sampling state (token history, seeded generator) the runner still holds: released when a
        plan lists them in ``finished_ids``, so a long-running server does not accumulate ended requests."""
        return set(self._sampled) | set(self._generators)

    def _sampled_rows_only(self, plan: StepPlan) -> bool:
        """Whether the model need only produce the sampled rows' hidden states: it supports that, some but not all
        rows are sampled, and no request wants prompt logprobs (they read every prompt row's state)."""
        return (
            self.model.supports_output_rows
            and 0 < len(plan.sampled_requests) < plan.num_tokens
            and all(req.sampling_params.prompt_logprobs is None for req in plan.requests)
        )

    def _graph_bucket(self, plan: StepPlan) -> int | None:
        """The decode graph for this step: every request runs one new token and is sampled."""
        if self.graphs is None or not (plan.num_tokens == len(plan.requests) == len(plan.sampled_requests)):
            return None
        return self.graphs.bucket_for(plan.num_tokens, int(plan.seq_lens.max()), plan.block_tables.shape[1])

    def _tensor(self, array: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        t = torch.from_numpy(array)
        if t.dtype != dtype:
            t = t.to(dtype)
        return to_device(t, self.device)

    def _attention_metadata(self, plan: StepPlan) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self._tensor(plan.query_start_loc, torch.int32),
            seq_lens=self._tensor(plan.seq_lens, torch.int32),
            slot_mapping=self._tensor(plan.slot_mapping, torch.int64),
            block_tables=self._tensor(plan.block_tables, torch.int32),
            query_start_loc_cpu=plan.query_start_loc.tolist(),
            seq_lens_cpu=plan.seq_lens.tolist(),
        )

    def _sample(self, requests: list[Request], logits: torch.Tensor, step: PendingStep) -> None:
        """Queue sampling and the non-blocking copy of the sampled ids to the host."""
        histories = [self._sampled.setdefault(req.request_id, []) for req in requests]
        rows = [
            SamplingRow(req.sampling_params, history, req.prompt_token_ids, self._generator(req))  # type: ignore[arg-type]
            for req, history in zip(requests, histories, strict=True)
        ]
        masked = self.grammars.token_mask(requests) if self.grammars is not None else None
        batch = SamplingBatch.build(rows, self.vocab_size, self.device, self.eos_token_ids,
                                    token_mask=masked[1] if masked else None)
        out = self.sampler(logits, batch)
        step.set_sampled(out.sampled_token_ids, histories)
        step.grammar_rows = masked[0] if masked else []
        if out.logprobs is not None:
            step.logprobs = (out.logprobs, batch.num_logprobs)

    def _embed(self, requests: list[Request], hidden: torch.Tensor, step: PendingStep) -> None:
        """Queue the embeddings of the embedding requests among the sampled rows (``hidden``: the final-normed
        states of those rows, in order): each is its last prompt token's state, L2-normalised in f32."""
        rows = [i for i, req in enumerate(requests) if req.sampling_params.embed]  # type: ignore[attr-defined]
        if not rows:
            return
        vectors = torch.nn.functional.normalize(hidden[self._tensor(np.array(rows), torch.int64)].float(), dim=-1)
        step.embeddings = ([requests[i].request_id for i in rows], vectors)

    def _generator(self, req: Request) -> torch.Generator | None:
        params: SamplingParams = req.sampling_params  # type: ignore[assignment]
        if params.seed is None or params.is_greedy:
            return None
        gen = self._generators.get(req.request_id)
        if gen is None:
            gen = self._generators[req.request_id] = make_generator(params.seed, self.device)
        return gen

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor, step: PendingStep) -> None:
        """Queue the logprobs of the prompt tokens this step computed, for requests that asked for them."""
        qsl = plan.query_start_loc
        for i, req in enumerate(plan.requests):
            params: SamplingParams = req.sampling_params  # type: ignore[assignment]
            start = plan.start_positions[i]
            if params.prompt_logprobs is None or start >= req.num_prompt_tokens:
                continue
            # Row j (position start + j) predicts prompt token start + j + 1 while that is still a prompt token.
            n_rows = min(plan.num_new_tokens[i], req.num_prompt_tokens - 1 - start)
            lp = None
            if n_rows > 0:
                first = int(qsl[i])
                logits = self.model.compute_logits(hidden[first : first + n_rows])
                targets = to_device(torch.tensor(req.prompt_token_ids[start + 1 : start + 1 + n_rows]), self.device)
                lp = prompt_logprobs(logits, targets, params.prompt_logprobs)
            step.prompt_logprobs[req.request_id] = (start, lp, params.prompt_logprobs, n_rows)

    # ---- reading a step back -----------------------------------------------------------------------------

    def _read_back(self, step: PendingStep) -> None:
        """Finish a popped pending step: wait for its ids, advance grammars, extend histories, build the
        result. An error is kept on the step (raised by :meth:`collect`), so later steps can still finish."""
        try:
            result = StepResult(step.plan.step_id, step.wait_for_ids(), [])
            if step.grammar_rows:
                assert self.grammars is not None
                self.grammars.advance(step.requests, step.grammar_rows, result.sampled_token_ids)
            for history, token in zip(step.histories, result.sampled_token_ids, strict=True):
                history.append(token)
            if step.logprobs is None:
                result.logprobs = [None] * len(step.requests)
            else:
                tensors, num_top = step.logprobs
                result.logprobs = tensors.tolists(num_top)
            for request_id, (start, lp, k, n_rows) in step.prompt_logprobs.items():
                # Row j predicts prompt token start + j + 1; token 0 (no prediction) is None.
                entries: list[TokenLogprobs | None] = [None] if start == 0 else []
                if lp is not None:
                    entries.extend(lp.tolists([k] * n_rows))
                result.prompt_logprobs[request_id] = PromptLogprobsChunk(0 if start == 0 else start + 1, entries)
            if step.embeddings is not None:
                ids, vectors = step.embeddings
                result.embeddings = dict(zip(ids, vectors.tolist(), strict=True))
            step.result = result
        except Exception as exc:  # reported through collect(); the runner itself stays usable
            step.error = exc
        finally:
            step.release()


def _is_identity(index: np.ndarray, n: int) -> bool:
    """Whether ``index`` is 0, 1, ..., n - 1."""
    return index.shape[0] == n and bool((index == np.arange(n)).all())
