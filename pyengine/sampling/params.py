"""Per-request sampling parameters with vLLM's names, defaults and validation.

Users port code from vLLM and clients send OpenAI fields, so the names and ranges follow both. A field counts
as *explicitly set* when it was passed to the constructor with a value other than None; server defaults
(CLI flags, generation_config.json, see ``defaults.py``) only fill the fields a request left unset.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # OpenAI / vLLM's cap on top-k logprobs per token
MIN_TEMPERATURE = 0.01  # vLLM raises smaller positive temperatures to this to keep logits / t finite
LOGIT_BIAS_LIMIT = 100.0  # OpenAI clamps biases to [-100, 100]
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """A grammar the output must follow (OpenAI's ``response_format``; the chat layer's ``tool_choice``).

    Exactly one field is set: ``json_schema`` (a JSON Schema object the whole output must validate against)
    or ``json_object`` (any JSON object). The schema itself is checked against the grammar library, which
    needs the tokenizer, by ``candle_vllm.pyengine.structured_output.check_structured_output``.
    """

    json_schema: dict[str, Any] | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        if (self.json_schema is not None) == bool(self.json_object):
            raise ValueError("structured_output: set exactly one of json_schema or json_object=True")
        if self.json_schema is not None:
            if not isinstance(self.json_schema, dict):
                raise ValueError(f"structured_output: json_schema must be a JSON object (dict), "
                                 f"got {type(self.json_schema).__name__}")
            try:
                json.dumps(self.json_schema, allow_nan=False)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"structured_output: json_schema is not plain JSON ({exc})") from None


@dataclass(init=False)
class SamplingParams:
    """How to pick the tokens of one request (vLLM's ``SamplingParams``; the sampler reads it per row).

    ``temperature=0`` means greedy. ``top_k`` 0 or -1 disables top-k (stored as 0). ``max_tokens=None`` means
    "up to the context length or the server's cap", resolved by the engine. ``logprobs``/``prompt_logprobs``
    ask for that many top alternatives (0..20) besides the chosen token; the values are the model's raw
    log-probabilities (before penalties, temperature and truncation), as vLLM reports by default; on a row
    constrained by ``structured_output`` they are taken after the grammar's mask (forbidden tokens -inf, the
    rest renormalised), as vLLM applies the grammar bitmask before its sampler.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's: the only tokens the row may produce (a classifier's labels, a choice's first tokens); None: any
    allowed_token_ids: list[int] | None = None
    # vLLM's: words the output never contains; the engine tokenizes them into bad_words_token_ids (bad_words.py),
    # which offline code may also give directly
    bad_words: list[str] = field(default_factory=list)
    bad_words_token_ids: list[list[int]] | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Kept for vLLM's signature: like vLLM's detokenizer for fast tokenizers (the only kind here), special tokens
    # decode as the tokenizer's own decoder joins them, so this has no effect.
    spaces_between_special_tokens: bool = True
    detokenize: bool = True  # False: token ids only (text and logprobs' decoded_token stay empty), as in vLLM
    structured_output: StructuredOutputParams | None = None
    # vLLM's: keep only the prompt's last k tokens (-1: the model's context length), for documents longer than the
    # context; the engine cuts the prompt when it takes the request (``truncate_prompt``).
    truncate_prompt_tokens: int | None = None
    # An embedding request (``LLM.embed``, ``/v1/embeddings``): the engine runs the prompt and one token, and the
    # output carries the last prompt token's final hidden state, L2-normalised (``RequestOutput.embedding``).
    embed: bool = False

    def __init__(self, **params: Any) -> None:
        """Take vLLM's keyword arguments; None means "not set" (defaults, server defaults may apply)."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(params.keys() - names)
        if unknown:
            raise ValueError(f"unknown sampling parameter(s) {unknown}; supported: {sorted(names)}")
        given = {name: value for name, value in params.items() if value is not None}
        for f in dataclasses.fields(self):
            if f.name in given:
                value = given[f.name]
            elif f.default_factory is not dataclasses.MISSING:
                value = f.default_factory()
            else:
                value = f.default
            setattr(self, f.name, value)
        self._normalize()
        self._validate()
        self._explicit: frozenset[str] = frozenset(given)  # from now on __setattr__ tracks changes

    def __setattr__(self, name: str, value: Any) -> None:
        """A field set after construction is the caller's own, as if passed to the constructor (vLLM users
        change params that way), so server defaults no longer fill it; None unsets it. The engine normalizes
        and validates the params again when it takes the request (``with_defaults``)."""
        explicit: frozenset[str] | None = getattr(self, "_explicit", None)
        if explicit is None or name not in _FIELD_NAMES:
            object.__setattr__(self, name, value)
            return
        if value is None:
            f = _FIELDS[name]
            value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            object.__setattr__(self, "_explicit", explicit - {name})
        else:
            object.__setattr__(self, "_explicit", explicit | {name})
        object.__setattr__(self, name, value)

    @property
    def explicit_fields(self) -> frozenset[str]:
        """Names of the fields the caller set; the rest may take server defaults."""
        return self._explicit

    @property
    def has_penalties(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies: such rows read their token history."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def bad_words_need_history(self) -> bool:
        """Whether a bad word of several tokens is banned only after its head: the ban reads the newest tokens."""
        return any(len(ids) > 1 for ids in self.bad_words_token_ids or ())

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the argmax of the (biased, penalised) logits and draw no random numbers."""
        return self.temperature == 0.0

    def with_settings(self, **settings: Any) -> SamplingParams:
        """A validated copy with ``settings`` applied as the caller's own (explicit); the other fields keep whether
        they were set. ``dataclasses.replace`` would mark every field explicit, and server defaults would then
        never reach the request."""
        return SamplingParams(**{**{name: getattr(self, name) for name in self._explicit}, **settings})

    def with_defaults(self, defaults: Mapping[str, Any]) -> SamplingParams:
        """A validated copy where the fields this request left unset take ``defaults``; explicit ones stay."""
        current = {name: getattr(self, name) for name in self._explicit}
        fills = {name: value for name, value in defaults.items() if name not in self._explicit}
        filled = SamplingParams(**fills, **current)
        filled._explicit = self._explicit
        return filled

    def check_vocab(self, vocab_size: int) -> None:
        """Reject token ids the model cannot produce (the intake calls this once the model is known)."""
        bad_bias = sorted(t for t in self.logit_bias if t >= vocab_size)
        if bad_bias:
            raise ValueError(
                f"logit_bias has token ids {bad_bias} outside the vocabulary (size {vocab_size})"
            )
        bad_stop = sorted(t for t in self.stop_token_ids if t >= vocab_size)
        if bad_stop:
            raise ValueError(f"stop_token_ids {bad_stop} are outside the vocabulary (size {vocab_size})")
        bad_words = sorted(t for ids in self.bad_words_token_ids or () for t in ids if t >= vocab_size)
        if bad_words:
            raise ValueError(f"bad_words_token_ids {bad_words[:5]} are outside the vocabulary (size {vocab_size})")
        bad_allowed = sorted(t for t in self.allowed_token_ids or () if t >= vocab_size)
        if bad_allowed:
            raise ValueError(f"allowed_token_ids {bad_allowed[:5]} are outside the vocabulary (size {vocab_size})")

    def _normalize(self) -> None:
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            setattr(self, name, _as_float(name, getattr(self, name)))
        for name in ("n", "top_k", "min_tokens"):
            setattr(self, name, _as_int(name, getattr(self, name)))
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            setattr(self, name, None if value is None else _as_int(name, value))
        if self.seed == -1:  # vLLM's "no seed"
            self.seed = None
        if self.top_k == -1:
            self.top_k = 0
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s raised to %s to keep logits finite", self.temperature, MIN_TEMPERATURE
            )
            self.temperature = MIN_TEMPERATURE
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError("stop must be a string or a list of strings, stop_token_ids a list of integers")
        self.stop = list(self.stop)
        self.stop_token_ids = [_as_int("stop_token_ids", t) for t in self.stop_token_ids]
        self.logit_bias = _normalize_logit_bias(self.logit_bias)
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = [[_as_int("bad_words_token_ids", t) for t in ids]
                                        for ids in self.bad_words_token_ids]
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple, set, frozenset)):
                raise ValueError("allowed_token_ids must be a list of integers")
            self.allowed_token_ids = sorted({_as_int("allowed_token_ids", t) for t in self.allowed_token_ids})

    def _validate(self) -> None:
        checks: list[tuple[bool, str]] = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0.0, f"temperature must be >= 0 (0 = greedy), got {self.temperature}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be 0 or -1 (disabled) or at least 1, got {self.top_k}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (self.repetition_penalty > 0.0, f"repetition_penalty must be > 0, got {self.repetition_penalty}"),
            (
                self.seed is None or _INT64_MIN <= self.seed <= _INT64_MAX,
                f"seed must fit in a signed 64-bit integer, got {self.seed}",
            ),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (
                all(t >= 0 for t in self.stop_token_ids),
                f"stop_token_ids must be >= 0, got {self.stop_token_ids}",
            ),
            (
                all(isinstance(s, str) and s for s in self.stop),
                "stop must be a string or a list of non-empty strings",
            ),
            (self.detokenize or not self.stop, "stop strings need detokenize=True"),
            (
                self.structured_output is None or isinstance(self.structured_output, StructuredOutputParams),
                f"structured_output must be a StructuredOutputParams, got {type(self.structured_output).__name__}",
            ),
            (
                self.structured_output is None or not self.ignore_eos,
                "ignore_eos cannot be combined with structured_output: the grammar ends the output with EOS",
            ),
            (
                not self.embed or (self.n == 1 and self.max_tokens == 1),
                "an embedding request (embed=True) runs one token for one choice: n=1 and max_tokens=1",
            ),
            (
                self.allowed_token_ids is None or (len(self.allowed_token_ids) > 0
                                                   and all(t >= 0 for t in self.allowed_token_ids)),
                f"allowed_token_ids must be a non-empty list of token ids, got {self.allowed_token_ids}",
            ),
            (
                all(isinstance(w, str) and w.strip() for w in self.bad_words),
                "bad_words must be a list of non-empty strings",
            ),
            (
                self.bad_words_token_ids is None or all(ids and min(ids) >= 0 for ids in self.bad_words_token_ids),
                "bad_words_token_ids must be non-empty lists of token ids",
            ),
            (
                truncation_ok(self.truncate_prompt_tokens),
                f"truncate_prompt_tokens must be -1 (the model's context length) or at least 1, got "
                f"{self.truncate_prompt_tokens}",
            ),
            (
                self.structured_output is None or self.min_tokens == 0,
                "min_tokens cannot be combined with structured_output: the grammar decides where the output ends",
            ),
        ]
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            checks.append(
                (
                    value is None or 0 <= value <= MAX_LOGPROBS,
                    f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}",
                )
            )
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    return int(value)


def truncation_ok(keep: int | None) -> bool:
    """Whether ``keep`` is a ``truncate_prompt_tokens`` value: unset, -1 or a positive count."""
    return keep is None or (isinstance(keep, int) and not isinstance(keep, bool) and (keep == -1 or keep >= 1))


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (-1: ``max_model_len`` of them), so a
    document longer than the context still runs with its start dropped. A count past the context, or not a valid
    value (``truncation_ok``), is a ValueError (vLLM's message)."""
    if keep is None:
        return ids
    if not truncation_ok(keep):
        raise ValueError(f"truncate_prompt_tokens must be -1 (the model's context length) or at least 1, got {keep}")
    keep = max_model_len if keep == -1 else keep
    if keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
                         "Please, select a smaller truncation size.")
    return ids[-keep:] if len(ids) > keep else ids


_FIELDS = {f.name: f for f in dataclasses.fields(SamplingParams)}
_FIELD_NAMES = frozenset(_FIELDS)


def _normalize_logit_bias(bias: Mapping[Any, Any]) -> dict[int, float]:
    """Token ids may arrive as JSON strings; biases are clamped to [-100, 100] as OpenAI does."""
    if not isinstance(bias, Mapping):
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if token < 0 or (isinstance(key, float) and key != token):
            raise ValueError(f"logit_bias keys must be non-negative token ids, got {key!r}")
        out[token] = min(LOGIT_BIAS_LIMIT, max(-LOGIT_BIAS_LIMIT, _as_float("logit_bias value", value)))
    return out
