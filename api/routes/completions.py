"""``POST /v1/completions``: text or token-id prompts (one or a batch), echo, integer logprobs, vLLM's
``prompt_logprobs``, SSE or JSON.

A batch of prompts runs as one engine request per prompt; choice ``index`` is ``prompt_i * n + j``. With
``echo`` and ``max_tokens: 0`` (prompt scoring) the engine runs one token, which the answer leaves out.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from quart import Blueprint

from candle_vllm.api import sse
from candle_vllm.api.beam_search import BeamSearchRun, beam_outputs, beam_search_params
from candle_vllm.api.generation import EngineRequest, KeepAlive
from candle_vllm.api.limits import TokenLimits
from candle_vllm.api.logprobs import CompletionLogprobs, prompt_logprobs_json
from candle_vllm.api.prompts import check_token_ids, sampling_params, truncated_prompt
from candle_vllm.api.routes.common import (
    check_model,
    collect,
    event_stream,
    get_state,
    in_worker,
    now_s,
    read_json,
    submit,
)
from candle_vllm.api.routes.common import usage as usage_of
from candle_vllm.api.schemas import CompletionRequest, parse_request
from candle_vllm.pyengine.outputs import CompletionOutput, RequestOutput
from candle_vllm.pyengine.sampling.params import SamplingParams

bp = Blueprint("completions", __name__)


@dataclass(slots=True)
class _Prompt:
    text: str
    ids: list[int]
    max_tokens: int | None  # what the engine runs it with (None: the engine's default)


def _prompts(req: CompletionRequest, tokenizer: Any, limits: TokenLimits) -> list[_Prompt]:
    """Each prompt's text, ids and token limit, length-checked (runs in a worker thread: tokenizing megabytes
    takes seconds)."""
    out = []
    for i, item in enumerate(req.prompts()):
        param = "prompt" if not isinstance(req.prompt, list) else f"prompt.{i}"
        if isinstance(item, str):
            ids = tokenizer.encode(item, add_special_tokens=req.add_special_tokens)
        else:
            check_token_ids(item, tokenizer.vocab_size, param)
            ids = item
        kept = truncated_prompt(ids, req.truncate_prompt_tokens, limits.max_model_len)
        # echo shows what the model read: the text itself, or the ids decoded (token ids given, or a cut prompt)
        text = item if isinstance(item, str) and kept is ids else \
            tokenizer.decode(kept, skip_special_tokens=False) if req.echo else ""
        out.append(_Prompt(text, kept, limits.resolve(len(kept), req.token_limit())))
    return out


def _engine_params(req: CompletionRequest, prompts: list[_Prompt], vocab_size: int) -> list[SamplingParams]:
    """Each prompt's ``SamplingParams``; prompts differ only in a defaulted ``max_tokens`` (clamped to what fits
    after each), so one object is built per distinct limit. The prompt's logprobs serve both ``echo`` with
    ``logprobs`` and ``prompt_logprobs``: the engine computes the larger top-k, each view shows its own."""
    wanted = [k for k in (req.logprobs if req.echo else None, req.prompt_logprobs) if k is not None]
    prompt_logprobs = max(wanted) if wanted else None
    by_limit: dict[int | None, SamplingParams] = {}
    for p in prompts:
        if p.max_tokens not in by_limit:
            by_limit[p.max_tokens] = sampling_params(req, p.max_tokens, vocab_size, logprobs=req.logprobs,
                                                     prompt_logprobs=prompt_logprobs)
    return [by_limit[p.max_tokens] for p in prompts]


@bp.post("/v1/completions")
async def completions() -> Any:
    state = get_state()
    req = parse_request(CompletionRequest, await read_json())
    model = check_model(state, req.model)
    req.scores_prompt_only()  # max_tokens 0 without echo is a 400 before any tokenizing
    tokenizer = state.engine.tokenizer
    prompts = await in_worker(state, _prompts, req, tokenizer, state.token_limits)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    view = CompletionView(req, request_id, model, now_s(), prompts, tokenizer,
                          req.tokens_as_ids(state.config.return_tokens_as_token_ids))
    if req.use_beam_search:
        context = state.token_limits.max_model_len
        searches = await BeamSearchRun(state, request_id).run(
            [p.ids for p in prompts], [beam_search_params(req, p.max_tokens or context - len(p.ids)) for p in prompts])
        return view.response([beam_outputs(s, f"{request_id}-{i}", p.text or None, tokenizer,
                                           req.skip_special_tokens)[0]
                              for i, (s, p) in enumerate(zip(searches, prompts, strict=True))])
    params = _engine_params(req, prompts, tokenizer.vocab_size)
    requests = [EngineRequest(f"{request_id}-{i}", p.ids, ps, p.text or None, req.priority)
                for i, (p, ps) in enumerate(zip(prompts, params, strict=True))]
    batch, outputs, head = await submit(state, requests, req.stream)
    if req.stream:
        return event_stream(batch, view, head, outputs)
    try:
        last = await collect(outputs, len(prompts))
    finally:
        await batch.close()
    return view.response(last)


class CompletionView(sse.EventStream):
    """Builds ``text_completion`` objects (whole, or chunk by chunk) for the prompts of one request.

    For prompt scoring (``prompt_only``) the engine's one generated token is left out of text, logprobs and
    usage, and every choice ends with ``length`` (the zero tokens asked for were all generated), as in vLLM."""

    def __init__(self, req: CompletionRequest, request_id: str, model: str, created: int, prompts: list[_Prompt],
                 tokenizer: Any, as_ids: bool = False) -> None:
        self.req = req
        self.as_ids = as_ids  # logprobs name tokens "token_id:N"
        self.base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        self.prompts = prompts
        self.tokenizer = tokenizer
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.last: list[RequestOutput | None] = [None] * len(prompts)
        self.started: set[int] = set()
        self.finished: set[int] = set()
        self.logprobs: dict[int, CompletionLogprobs] = {}
        self.prompt_only = req.scores_prompt_only()

    def _usage(self) -> dict[str, Any]:
        usage = usage_of(self.last, [len(p.ids) for p in self.prompts])
        if self.prompt_only:
            usage.update(completion_tokens=0, total_tokens=usage["prompt_tokens"])
        return usage

    def _choice(self, prompt_i: int, out: RequestOutput | None, c: CompletionOutput, whole: bool) -> dict[str, Any]:
        """A choice with the text/logprobs since the last chunk (``whole``: everything, for a response)."""
        index = prompt_i * self.req.n + c.index
        first = index not in self.started
        self.started.add(index)
        text = c.text if whole else c.text_delta
        ids = c.token_ids if whole else c.token_ids_delta
        entries = c.logprobs if whole else c.logprobs_delta
        finish, stop_reason = c.finish_reason, c.stop_reason
        if self.prompt_only:
            text, ids, entries, stop_reason = "", [], [], None
            if finish not in (None, "abort"):
                finish = "length"
        prompt = self.prompts[prompt_i]
        if self.req.echo and first:
            text = prompt.text + text
        logprobs = None
        if self.req.logprobs is not None:
            acc = self.logprobs.setdefault(index, CompletionLogprobs(self.req.logprobs, self.tokenizer,
                                                                     as_ids=self.as_ids))
            if self.req.echo and first:
                prompt_entries = (out.prompt_logprobs if out else None) or [None] * len(prompt.ids)
                acc.add(prompt.ids, prompt_entries)
            acc.add(ids, entries or [{} for _ in ids])
            logprobs = acc.take()
        if finish:
            self.finished.add(index)
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}
        if self.req.return_token_ids:  # vLLM's: the prompt's ids with a choice's first chunk, then each chunk's own
            choice["token_ids"] = list(ids)
            if first:
                choice["prompt_token_ids"] = prompt.ids
        return choice

    def response(self, last: list[RequestOutput | None]) -> dict[str, Any]:
        self.last = last
        choices = []
        for prompt_i, out in enumerate(last):
            by_index = {c.index: c for c in (out.outputs if out else [])}
            for j in range(self.req.n):
                c = by_index.get(j) or CompletionOutput(index=j)
                choice = self._choice(prompt_i, out, c, whole=True)
                choice["finish_reason"] = choice["finish_reason"] or "abort"
                choice["prompt_logprobs"] = self._prompt_logprobs(out)
                choices.append(choice)
        return {**self.base, "choices": choices, "usage": self._usage()}

    def _prompt_logprobs(self, out: RequestOutput | None) -> list[dict[str, Any] | None] | None:
        """vLLM's per-choice ``prompt_logprobs`` (null unless asked for; never in a stream, which refuses it)."""
        k = self.req.prompt_logprobs
        if k is None or out is None or out.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(out.prompt_logprobs, k)

    def _chunk(self, choices: list[dict[str, Any]]) -> bytes:
        body: dict[str, Any] = {**self.base, "choices": choices}
        if self.include_usage:
            body["usage"] = self._usage() if self.continuous_usage else None
        return sse.event(body)

    def _render(self, item: Any) -> list[bytes]:
        if isinstance(item, KeepAlive):
            return [sse.PING]
        prompt_i, out = item
        self.last[prompt_i] = out
        chunks = []
        for c in out.outputs:
            index = prompt_i * self.req.n + c.index
            if index in self.finished:
                continue
            # A chunk per engine output, as vLLM: tokens without text too (their text "" keeps a benchmark's
            # inter-token samples one per token).
            if c.text_delta or c.token_ids_delta or c.finish_reason or (self.req.echo and index not in self.started):
                chunks.append(self._chunk([self._choice(prompt_i, out, c, whole=False)]))
        return chunks

    def _abort_unfinished(self) -> list[bytes]:
        return [
            self._chunk([self._choice(prompt_i, self.last[prompt_i], CompletionOutput(index=j, finish_reason="abort"),
                                      whole=False)])
            for prompt_i in range(len(self.prompts))
            for j in range(self.req.n)
            if prompt_i * self.req.n + j not in self.finished
        ]
