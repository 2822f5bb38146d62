"""Server defaults fill only the fields a request left unset: request > CLI > generation_config > vLLM."""

from __future__ import annotations

import pytest

from candle_vllm.pyengine.sampling import SamplingDefaults, SamplingParams

GENERATION_CONFIG = {
    "temperature": 0.6,
    "top_p": 0.9,
    "top_k": 20,
    "repetition_penalty": 1.1,
    "do_sample": True,
    "eos_token_id": [2, 7],
    "max_new_tokens": 64,
    "min_p": None,
}


def test_precedence() -> None:
    model = SamplingDefaults.from_generation_config(GENERATION_CONFIG)
    assert model == SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1)
    server = model.overridden_by(SamplingDefaults(temperature=0.3, frequency_penalty=0.5))
    request = SamplingParams(top_p=0.5, max_tokens=12)
    got = server.apply(request)
    assert (got.temperature, got.top_p, got.top_k, got.repetition_penalty) == (0.3, 0.5, 20, 1.1)
    assert (got.frequency_penalty, got.presence_penalty, got.min_p, got.max_tokens) == (0.5, 0.0, 0.0, 12)
    assert got.explicit_fields == request.explicit_fields
    # The request object itself is untouched.
    assert (request.temperature, request.top_k) == (1.0, 0)


def test_explicit_value_equal_to_vllm_default_is_kept() -> None:
    got = SamplingDefaults(temperature=0.2, top_k=5).apply(SamplingParams(temperature=1.0, top_k=-1))
    assert (got.temperature, got.top_k) == (1.0, 0)


def test_applying_twice_uses_the_latest_defaults() -> None:
    once = SamplingDefaults(temperature=0.2).apply(SamplingParams())
    twice = SamplingDefaults(temperature=0.7).apply(once)
    assert (once.temperature, twice.temperature) == (0.2, 0.7)


def test_no_defaults_returns_an_equal_validated_copy() -> None:
    """Even with no defaults the engine takes a fresh copy: a field changed after construction is normalized
    and validated there, and the caller's object is never the engine's."""
    params = SamplingParams(seed=3)
    got = SamplingDefaults.from_generation_config(None).apply(params)
    assert got == params and got is not params and got.explicit_fields == {"seed"}


def test_invalid_default_is_reported() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 0.0"):
        SamplingDefaults.from_generation_config({"top_p": 0.0}).apply(SamplingParams())
