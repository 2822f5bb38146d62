"""How many tokens a request may generate: the context and KV-cache checks, and the default ``max_tokens``.

A limit the client set must fit, or the request is a 400 naming ``max_tokens`` (vLLM's checks). A request that
set none gets the server's default (``--max-gen-tokens``) clamped to what fits after its prompt: a client that
never sent ``max_tokens`` cannot lower it, so refusing the request for the default would leave it no way to
succeed (vLLM's default is likewise "whatever fits").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from candle_vllm.api.errors import bad_request
from candle_vllm.pyengine.scheduler.config import default_max_tokens, kv_room


@dataclass(frozen=True, slots=True)
class TokenLimits:
    """The bounds of one server's engine; None where the engine does not say (it then applies its own)."""

    max_model_len: int
    kv_capacity_tokens: int | None = None  # tokens the whole KV cache holds
    default_max_tokens: int | None = None  # --max-gen-tokens, the engine's default for unset max_tokens

    @classmethod
    def of(cls, engine: Any) -> TokenLimits:
        """Read the limits an ``AsyncEngine`` exposes (``info.kv_capacity_tokens``, ``core.max_gen_tokens``)."""
        info, core = getattr(engine, "info", None), getattr(engine, "core", None)
        return cls(engine.max_model_len, getattr(info, "kv_capacity_tokens", None),
                   getattr(core, "max_gen_tokens", None))

    def resolve(self, prompt_len: int, max_tokens: int | None) -> int | None:
        """The ``max_tokens`` to run a prompt of ``prompt_len`` tokens with (``max_tokens``: the client's, or
        None); 400 when the prompt, or the prompt with the client's ``max_tokens``, can never fit.

        One request needs KV for its prompt and every generated token but the last (``kv_room``)."""
        _check_context(prompt_len, max_tokens, self.max_model_len)
        kv = self.kv_capacity_tokens
        if kv is not None and prompt_len > kv:
            raise bad_request(f"the prompt has {prompt_len} tokens but this server's KV cache holds {kv} tokens; "
                              "shorten the prompt (or start the server with more --mem or --kv-fraction)",
                              param="input_tokens", code="context_length_exceeded")
        if max_tokens is not None:
            room = None if kv is None else kv_room(kv, prompt_len)
            if room is not None and max_tokens > room:
                raise bad_request(f"max_tokens {max_tokens} does not fit this server's KV cache ({kv} tokens) after "
                                  f"the prompt's {prompt_len} tokens; lower max_tokens to at most {room} (or "
                                  "start the server with more --mem or --kv-fraction)", param="max_tokens",
                                  code="context_length_exceeded")
            return max_tokens
        if self.default_max_tokens is None:
            return None
        return default_max_tokens(self.default_max_tokens, prompt_len, self.max_model_len, kv)


def _check_context(prompt_len: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's context checks: the prompt must leave room for one token, and prompt + max_tokens must fit."""
    if prompt_len == 0:
        raise bad_request("the prompt is empty after tokenization", param="prompt")
    if prompt_len >= max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens, but the prompt has "
                          f"{prompt_len} tokens; shorten the prompt", param="input_tokens",
                          code="context_length_exceeded")
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise bad_request(f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                          f"{prompt_len} tokens and max_tokens asks for {max_tokens} more; lower max_tokens",
                          param="max_tokens", code="context_length_exceeded")
