"""``POST /v1/chat/completions``: render the chat template, run the engine, answer JSON or an SSE stream.

Each choice's text goes through :class:`~candle_vllm.api.chat_output.ChoiceOutput` (reasoning split, then
tool-call reading) in both modes, so the stream accumulates to the whole response.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from quart import Blueprint

from candle_vllm.api import sse
from candle_vllm.api.beam_search import BeamSearchRun, beam_outputs, beam_search_params, token_by_token
from candle_vllm.api.chat_output import ChoiceDelta, ChoiceOutput
from candle_vllm.api.chat_tools import ToolPlan, check_tool_history, plan_tools
from candle_vllm.api.errors import bad_request
from candle_vllm.api.generation import EngineRequest, KeepAlive
from candle_vllm.api.logprobs import ChatLogprobs, prompt_logprobs_json
from candle_vllm.api.prompts import render_chat, sampling_params, truncated_prompt
from candle_vllm.api.reasoning import ReasoningSplitter, ThinkMarkers, prompt_opens_reasoning
from candle_vllm.api.routes.common import (
    check_model,
    event_stream,
    get_state,
    in_worker,
    now_s,
    read_json,
    submit,
)
from candle_vllm.api.routes.common import usage as usage_of
from candle_vllm.api.schemas import ChatCompletionRequest, parse_request
from candle_vllm.api.state import ServerState
from candle_vllm.pyengine.outputs import CompletionOutput, RequestOutput
from candle_vllm.pyengine.sampling.params import SamplingParams, StructuredOutputParams
from candle_vllm.pyengine.structured_output import check_structured_output

bp = Blueprint("chat", __name__)


@dataclasses.dataclass(slots=True)
class ChatSetup:
    """What every choice of one request shares: its tool plan and reasoning split."""

    tools: ToolPlan
    markers: ThinkMarkers | None  # None: the output is not split
    starts_in_reasoning: bool

    def choice(self) -> ChoiceOutput:
        splitter = None if self.markers is None else ReasoningSplitter(self.markers, self.starts_in_reasoning)
        return ChoiceOutput(splitter, self.tools.reader(), self.tools.parallel, self.tools.finishes_with_tool_calls)


def _is_special(tokenizer: Any, text: str) -> bool:
    token_id = tokenizer.token_to_id(text)
    added = tokenizer.hf.get_added_tokens_decoder()
    return token_id is not None and token_id in added and added[token_id].special


def _skips_special_tokens(req: ChatCompletionRequest, tokenizer: Any, setup: ChatSetup) -> bool:
    """The request's ``skip_special_tokens``, unless the reply's marker or call tags are special tokens: decoding
    must keep those for the reasoning split and the tool parsers."""
    markers = setup.markers
    keep = setup.tools.parses or (markers is not None and (_is_special(tokenizer, markers.start)
                                                          or _is_special(tokenizer, markers.end)))
    return req.skip_special_tokens and not keep


def _engine_params(req: ChatCompletionRequest, state: ServerState, setup: ChatSetup, limit: int | None,
                   top: int | None) -> SamplingParams:
    tokenizer = state.engine.tokenizer
    params = sampling_params(req, limit, tokenizer.vocab_size, logprobs=top, prompt_logprobs=req.prompt_logprobs)
    params = params.with_settings(skip_special_tokens=_skips_special_tokens(req, tokenizer, setup))
    schema = setup.tools.output_schema()
    if schema is not None:  # tool_choice required / named: the output is the calls' JSON
        if params.structured_output is not None:
            raise bad_request(f"response_format cannot be combined with tool_choice {setup.tools.mode!r}",
                              param="response_format")
        try:
            structured = StructuredOutputParams(json_schema=schema)
            check_structured_output(structured, None)
            params = params.with_settings(structured_output=structured)
        except ValueError as exc:
            raise bad_request(f"the tools' parameter schemas cannot constrain the output: {exc}",
                              param="tools") from None
    return params


def _prompt(tokenizer: Any, req: ChatCompletionRequest, tools: list[dict[str, Any]] | None, thinking: bool | None,
            trust_template: bool) -> tuple[str, list[int]]:
    """The rendered prompt and its token ids (runs in a worker thread)."""
    text = render_chat(tokenizer, req, tools, thinking, trust_template=trust_template)
    return text, tokenizer.encode(text, add_special_tokens=req.add_special_tokens)


@bp.post("/v1/chat/completions")
async def chat_completions() -> Any:
    return await chat_response(get_state(), parse_request(ChatCompletionRequest, await read_json()),
                               f"chatcmpl-{uuid.uuid4().hex}")


StreamFactory = Callable[..., "ChatStream"]


async def chat_response(state: ServerState, req: ChatCompletionRequest, request_id: str,
                        make_stream: StreamFactory | None = None) -> Any:
    """Serve a chat request: the whole ``chat.completion`` dict, or the SSE response of ``make_stream``'s events
    (``ChatStream``'s chunks by default; the Responses API renders the same pipeline as its own events)."""
    model = check_model(state, req.model)
    check_tool_history(req.messages)
    tools = plan_tools(req, state.mcp_tools(), state.tool_parser, model)
    thinking = req.thinking_switch()
    tokenizer = state.engine.tokenizer
    text, ids = await in_worker(state, _prompt, tokenizer, req, tools.tools, thinking,
                                state.config.trust_request_chat_template)
    markers = state.think_markers if thinking is not False else None
    setup = ChatSetup(tools, markers, markers is not None and prompt_opens_reasoning(text, markers))
    ids = truncated_prompt(ids, req.truncate_prompt_tokens, state.token_limits.max_model_len)
    limit = state.token_limits.resolve(len(ids), req.token_limit())
    stream = (make_stream or ChatStream)(req, request_id, model, now_s(), ids, state.chat_logprobs, setup,
                                         req.tokens_as_ids(state.config.return_tokens_as_token_ids))
    if req.use_beam_search:
        beams = beam_search_params(req, limit or state.token_limits.max_model_len - len(ids))
        [search] = await BeamSearchRun(state, request_id).run([ids], [beams])
        skip = _skips_special_tokens(req, tokenizer, setup)
        out, shown = beam_outputs(search, request_id, text, tokenizer, skip)
        return await stream.whole(token_by_token(out, shown, tokenizer, skip))
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = _engine_params(req, state, setup, limit, top)
    batch, outputs, head = await submit(state, [EngineRequest(request_id, ids, params, text, req.priority)], req.stream)
    if req.stream:
        return event_stream(batch, stream, head, outputs)
    try:
        return await stream.whole(outputs)
    finally:
        await batch.close()


class ChatStream(sse.EventStream):
    """Turns engine outputs into ``chat.completion.chunk`` events with OpenAI's invariants: the role once per
    choice with its first output, ``finish_reason`` exactly once per choice, optional usage chunk last. The
    same object folds the outputs into the whole ``chat.completion`` for non-streamed requests."""

    def __init__(self, req: ChatCompletionRequest, request_id: str, model: str, created: int, prompt_ids: list[int],
                 logprobs: ChatLogprobs, setup: ChatSetup, as_ids: bool = False) -> None:
        self.req = req
        self.as_ids = as_ids  # logprobs name tokens "token_id:N"
        self.base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        opts = req.stream_options
        self.include_usage = bool(opts and opts.include_usage)
        self.continuous_usage = bool(opts and opts.continuous_usage_stats)
        self.prompt_ids = prompt_ids
        self.prompt_len = len(prompt_ids)
        self.prompt_ids_sent = False
        self.logprobs = logprobs
        self.setup = setup
        self.choices = [setup.choice() for _ in range(req.n)]
        self.role_sent: set[int] = set()
        self.last: RequestOutput | None = None
        self.echo = req.echo_text()

    def _step(self, c: CompletionOutput) -> ChoiceDelta:
        """Run one output of a choice through its pipeline (finishing it with the engine's last output)."""
        choice = self.choices[c.index]
        delta = choice.push(c.text_delta, len(c.token_ids_delta))
        if c.finish_reason:
            delta.extend(choice.finish())
        return delta

    async def whole(self, outputs: AsyncIterator[Any]) -> dict[str, Any]:
        """The non-streaming ``chat.completion`` object; choices the engine never finished end as ``abort``."""
        finals: dict[int, CompletionOutput] = {}
        try:
            async for item in outputs:
                if isinstance(item, KeepAlive):
                    continue
                self.last = item[1]
                for c in item[1].outputs:
                    if not self.choices[c.index].finished:
                        self._step(c)
                        finals[c.index] = c
        except ValueError as exc:
            raise bad_request(str(exc)) from None  # the engine's admission errors
        body = []
        for i, choice in enumerate(self.choices):
            c = finals.get(i) or CompletionOutput(index=i)
            if not choice.finished:
                choice.finish()
            logprobs = None
            if self.req.logprobs:
                logprobs = {"content": self.logprobs.content(c.token_ids, c.logprobs or [], self.req.top_logprobs or 0,
                                                             self.as_ids)}
            message = choice.message()
            if self.echo:
                message["content"] = self.echo + (message["content"] or "")
            body.append({"index": i, "message": message, "logprobs": logprobs,
                         "finish_reason": choice.finish_reason(c.finish_reason), "stop_reason": c.stop_reason,
                         **({"token_ids": c.token_ids} if self.req.return_token_ids else {})})
        return {"id": self.base["id"], "object": "chat.completion", "created": self.base["created"],
                "model": self.base["model"], "choices": body, "usage": self._usage(),
                "prompt_logprobs": self._prompt_logprobs(),
                **({"prompt_token_ids": self.prompt_ids} if self.req.return_token_ids else {})}

    def _prompt_logprobs(self) -> list[dict[str, Any] | None] | None:
        """vLLM's top-level ``prompt_logprobs`` of a chat response (null unless asked for)."""
        k = self.req.prompt_logprobs
        if k is None or self.last is None or self.last.prompt_logprobs is None:
            return None
        return prompt_logprobs_json(self.last.prompt_logprobs, k)

    def _chunk(self, choices: list[dict[str, Any]], role: bool = False) -> bytes:
        """One chunk; with continuous usage, a choice's role chunk counts no completion tokens yet (as vLLM).
        With ``return_token_ids`` the first chunk carries the prompt's ids, as vLLM's does."""
        body: dict[str, Any] = {**self.base, "choices": choices}
        if self.req.return_token_ids and not self.prompt_ids_sent:
            body["prompt_token_ids"] = self.prompt_ids
            self.prompt_ids_sent = True
        if self.include_usage:
            usage = None
            if self.continuous_usage:
                usage = self._usage()
                if role:
                    usage = {"prompt_tokens": self.prompt_len, "completion_tokens": 0, "total_tokens": self.prompt_len}
            body["usage"] = usage
        return sse.event(body)

    def _choice_chunks(self, c: CompletionOutput) -> list[bytes]:
        out = []
        if c.index not in self.role_sent:
            self.role_sent.add(c.index)
            out.append(self._chunk([{"index": c.index, "delta": {"role": "assistant", "content": ""},
                                     "logprobs": None, "finish_reason": None}], role=True))
            if self.echo:  # vLLM sends the echoed text as the choice's first content, before any token
                out.append(self._chunk([{"index": c.index, "delta": {"content": self.echo}, "logprobs": None,
                                         "finish_reason": None}], role=True))
        choice = self.choices[c.index]
        if choice.finished:
            return out
        delta = self._step(c)
        wants_logprobs = self.req.logprobs and c.token_ids_delta
        # Plain content (no reasoning split, no call reader holding text back): a chunk per engine output, as vLLM,
        # even for tokens without text (a special token under ignore_eos, text held for a stop string), so a
        # benchmark's inter-token samples stay one per token.
        plain_token = choice.splitter is None and choice.reader is None and bool(c.token_ids_delta)
        if not (delta or wants_logprobs or c.finish_reason or plain_token):
            return out
        logprobs = None
        if self.req.logprobs:
            logprobs = {"content": self.logprobs.content(c.token_ids_delta, c.logprobs_delta or [],
                                                         self.req.top_logprobs or 0,
                                                         self.as_ids)}
        body = delta.to_json() if delta or not plain_token else {"content": ""}
        entry: dict[str, Any] = {"index": c.index, "delta": body, "logprobs": logprobs, "finish_reason": None}
        if self.req.return_token_ids:
            entry["token_ids"] = list(c.token_ids_delta)
        if c.finish_reason:
            entry["finish_reason"] = choice.finish_reason(c.finish_reason)
            entry["stop_reason"] = c.stop_reason
        out.append(self._chunk([entry]))
        return out

    def _render(self, item: Any) -> list[bytes]:
        if isinstance(item, KeepAlive):
            return [sse.PING]
        _, out = item
        self.last = out
        return [chunk for c in out.outputs for chunk in self._choice_chunks(c)]

    def _abort_unfinished(self) -> list[bytes]:
        return [chunk for i, choice in enumerate(self.choices) if not choice.finished
                for chunk in self._choice_chunks(CompletionOutput(index=i, finish_reason="abort"))]

    def _usage(self) -> dict[str, Any]:
        usage = usage_of([self.last], [self.prompt_len])
        if self.setup.markers is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in self.choices)}
        return usage
