"""Request bodies of the OpenAI-compatible routes (pydantic models) and their validation.

The models accept unknown fields (clients send vendor extras such as ``ignore_eos`` or ``chat_template_kwargs``)
and declare the ranges OpenAI and vLLM enforce, so a bad value is a 400 naming the parameter, and
``/openapi.json`` documents the same constraints the server checks.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from candle_vllm.api.errors import APIError, bad_request

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TOP_LOGPROBS = 20
MAX_N = 128

NonNegInt = Annotated[int, Field(ge=0)]
M = TypeVar("M", bound=BaseModel)


class _Open(BaseModel):
    """Base for request models: unknown fields are kept (and ignored) instead of rejected."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(_Open):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ResponseFormat(_Open):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatMessage(_Open):
    """One message; content is text, a list of content parts, or null (assistant turns with tool calls).

    Assistant turns may carry ``tool_calls``; ``role: "tool"`` turns answer one of them by ``tool_call_id``."""

    role: str = Field(min_length=1)
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class FunctionSpec(_Open):
    """A callable function offered to the model: its name and the JSON schema of its arguments."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(_Open):
    """``tools[i]``: only function tools exist in the chat API."""

    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedFunction(_Open):
    name: str = Field(min_length=1)


class NamedToolChoice(_Open):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: the model must call that function."""

    type: Literal["function"] = "function"
    function: NamedFunction


class ThinkingConfig(_Open):
    """``thinking: {"type": "enabled" | "disabled"}`` as Anthropic-style clients send it."""

    type: Literal["enabled", "disabled"]


class SamplingFields(_Open):
    """Fields shared by chat and completions that map onto ``SamplingParams``."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=100.0)
    logit_bias: dict[str, float] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegInt] | None = None
    allowed_token_ids: list[NonNegInt] | None = None  # vLLM's: the only tokens the output may hold
    bad_words: list[str] | None = None  # vLLM's: words the output never contains
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    max_tokens: int | None = Field(None, ge=1)
    skip_special_tokens: bool = True
    # vLLM's; as in vLLM's detokenizer for fast tokenizers (the only kind here), no effect on the text
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = Field(None, ge=-1, strict=True)  # vLLM's: keep the prompt's last k tokens
    prompt_logprobs: int | None = Field(None, ge=-1, strict=True)  # vLLM's: each prompt token's logprob and top k
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name tokens "token_id:N" (None: the server's)
    return_token_ids: bool = False  # vLLM's: choices carry their token ids, the response its prompt's
    use_beam_search: bool = False  # vLLM's: n beams (api/beam_search.py)
    priority: int = Field(0, strict=True)  # vLLM's: lower runs first (--scheduling-policy priority; else only 0)
    length_penalty: float = Field(1.0, allow_inf_nan=False)  # vLLM's: beam scores divided by length ** this
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options can only be set when stream is true")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported; leave best_of unset")
        _check_prompt_logprobs(self.prompt_logprobs, self.stream)
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias values must be within [-100, 100], got {value} for token {key}")
        return self

    def tokens_as_ids(self, server_default: bool) -> bool:
        """Whether logprobs name tokens ``token_id:N``: the request's choice, else the server's
        (``--return-tokens-as-token-ids``), as vLLM decides."""
        return server_default if self.return_tokens_as_token_ids is None else self.return_tokens_as_token_ids

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _check_prompt_logprobs(k: int | None, stream: bool) -> None:
    """vLLM's rules, with its messages: no prompt logprobs in a stream (vLLM lets 0 through and returns nothing;
    here any value is refused rather than ignored), and at most the server's cap (-1, the whole vocabulary, is
    over it)."""
    if k is None:
        return
    if stream:
        raise bad_request("`prompt_logprobs` are not available when `stream=True`.", param="prompt_logprobs")
    if k == -1 or k > MAX_TOP_LOGPROBS:
        asked = "-1 (the whole vocabulary)" if k == -1 else str(k)
        raise bad_request(f"Requested prompt logprobs of {asked}, which is greater than max allowed: "
                          f"{MAX_TOP_LOGPROBS}", param="prompt_logprobs")


def _check_continuation(add_generation_prompt: bool, continue_final_message: bool) -> None:
    """vLLM's rule: continuing the last message and opening a new assistant turn exclude each other."""
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false to continue the last message")


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the reply goes on with the last message (a prefilled answer)
    documents: list[dict[str, Any]] | None = None  # for RAG chat templates (transformers' ``documents``)
    enable_thinking: bool | None = None
    thinking: bool | ThinkingConfig | None = None
    echo: bool = False  # vLLM's: the reply starts with the last message when that message has the reply's role
    add_special_tokens: bool = False  # vLLM's: the rendered prompt gets the tokenizer's BOS etc. too (templates add them)

    @model_validator(mode="after")
    def _check_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        _check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """``tools`` as plain dicts (what chat templates and tool parsers read)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def thinking_switch(self) -> bool | None:
        """The request's reasoning switch from ``chat_template_kwargs.enable_thinking``, ``enable_thinking`` or
        ``thinking`` (None: not asked, the model's default). Contradicting values are a 400."""
        given: list[tuple[str, bool]] = []
        kwargs = self.chat_template_kwargs or {}
        for key in ("enable_thinking", "thinking"):
            if isinstance(kwargs.get(key), bool):
                given.append((f"chat_template_kwargs.{key}", kwargs[key]))
        if self.enable_thinking is not None:
            given.append(("enable_thinking", self.enable_thinking))
        if isinstance(self.thinking, bool):
            given.append(("thinking", self.thinking))
        elif self.thinking is not None:
            given.append(("thinking.type", self.thinking.type == "enabled"))
        if len({value for _, value in given}) > 1:
            shown = ", ".join(f"{name}={str(value).lower()}" for name, value in given)
            raise bad_request(f"contradicting thinking switches ({shown}); give one", param=given[0][0])
        return given[0][1] if given else None

    def echo_text(self) -> str:
        """What vLLM's chat ``echo`` puts before the reply: the last message's text when its role is the reply's
        (assistant; with ``add_generation_prompt`` false, the last message's own role, as vLLM decides), else
        nothing. Content parts give their texts joined by newlines."""
        last = self.messages[-1]
        reply_role = "assistant" if self.add_generation_prompt else last.role
        if not self.echo or last.role != reply_role or last.content is None:
            return ""
        if isinstance(last.content, str):
            return last.content
        return "\n".join(str(part["text"]) for part in last.content if "text" in part)

    def token_limit(self) -> int | None:
        """``max_completion_tokens`` wins over the deprecated ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


PromptInput = str | list[str] | list[int] | list[list[int]]


def prompt_batch(p: PromptInput) -> list[str | list[int]]:
    """A prompt input as a list: each item is text or token ids."""
    if isinstance(p, str):
        return [p]
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: the prompt is text, token ids, or a batch of either."""

    prompt: PromptInput
    max_tokens: int | None = Field(None, ge=0)  # 0 only with echo: see scores_prompt_only
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: text prompts get the tokenizer's BOS etc.

    @model_validator(mode="after")
    def _check_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported; put the whole text in prompt")
        if isinstance(self.prompt, list) and (
            not self.prompt or any(isinstance(p, list | str) and not p for p in self.prompt)
        ):
            raise ValueError("prompt must not be empty")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch as a list: each item is text or token ids."""
        return prompt_batch(self.prompt)

    def scores_prompt_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: vLLM's prompt scoring (lm-eval's loglikelihood), which answers the
        prompt's tokens and logprobs and generates nothing. ``max_tokens: 0`` without ``echo`` is a 400."""
        if self.max_tokens != 0:
            return False
        if not self.echo:
            raise bad_request("max_tokens 0 generates nothing and is accepted only with echo true (to score the "
                              "prompt); ask for at least 1 token", param="max_tokens")
        return True

    def token_limit(self) -> int | None:
        """The ``max_tokens`` the engine runs with. The engine generates at least one token, so prompt scoring
        (``max_tokens: 0``) runs one, with prompt logprobs, and the answer leaves it out."""
        return 1 if self.max_tokens == 0 else self.max_tokens


class EmbeddingRequest(_Open):
    """``POST /v1/embeddings``: text or token ids, or a batch of either. The openai SDK asks for base64 unless the
    caller chose, and decodes it as little-endian float32."""

    model: str | None = None
    input: PromptInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, strict=True)
    user: str | None = None
    add_special_tokens: bool = True  # vLLM's: text inputs get the tokenizer's BOS etc.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, strict=True)  # vLLM's: keep each input's last k tokens

    @field_validator("input")
    @classmethod
    def _check_input(cls, value: PromptInput) -> PromptInput:
        if not value or any(isinstance(p, list | str) and not p for p in value):
            raise ValueError("input must not be empty (nor hold an empty string or token list)")
        return value

    def inputs(self) -> list[str | list[int]]:
        """The batch as a list: each item is text or token ids."""
        return prompt_batch(self.input)


class TokenizeRequest(_Open):
    """``POST /tokenize``: a completion prompt or chat messages, as vLLM's tokenizer endpoint takes them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages (as chat)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    documents: list[dict[str, Any]] | None = None
    return_token_strs: bool = False
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        _check_continuation(self.add_generation_prompt, self.continue_final_message)
        return self


class DetokenizeRequest(_Open):
    """``POST /detokenize``."""

    model: str | None = None
    tokens: list[NonNegInt]


def parse_request(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body; any problem becomes a 400 naming the first offending parameter."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


def validation_error(exc: ValidationError) -> APIError:
    """A 400 listing pydantic's complaints (at most three) with ``param`` set to the first location."""
    errors = exc.errors(include_url=False, include_input=False)
    parts = []
    for err in errors[:3]:
        loc = ".".join(str(x) for x in err["loc"])
        msg = str(err["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    first_loc = ".".join(str(x) for x in errors[0]["loc"]) if errors else ""
    return bad_request("; ".join(parts) or "invalid request", param=first_loc or None)
