"""SamplingParams: vLLM's defaults, normalisation, validation messages, explicit-field tracking."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from candle_vllm.pyengine.sampling import SamplingParams

# vLLM's documented defaults (vllm/sampling_params.py), except max_tokens: None = up to the context / cap.
VLLM_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "logit_bias": {},
    "stop": [],
    "stop_token_ids": [],
    "include_stop_str_in_output": False,
    "ignore_eos": False,
    "max_tokens": None,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
}


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    assert {name: getattr(params, name) for name in VLLM_DEFAULTS} == VLLM_DEFAULTS
    assert params.explicit_fields == frozenset()
    assert not params.is_greedy


def test_none_means_unset() -> None:
    params = SamplingParams(temperature=None, top_k=None, stop=None, logit_bias=None, seed=None)
    assert params == SamplingParams()
    assert params.explicit_fields == frozenset()


def test_normalisation() -> None:
    params = SamplingParams(
        top_k=-1, seed=-1, stop="###", temperature=0.001, logit_bias={"5": 150, 7: -300.5, 3: 0.5}
    )
    assert params.top_k == 0
    assert params.seed is None
    assert params.stop == ["###"]
    assert params.temperature == 0.01  # vLLM's floor for positive temperatures
    assert params.logit_bias == {5: 100.0, 7: -100.0, 3: 0.5}
    assert SamplingParams(temperature=0).is_greedy
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_explicit_fields() -> None:
    params = SamplingParams(temperature=1.0, top_p=None, max_tokens=5, stop=["x"])
    assert params.explicit_fields == {"temperature", "max_tokens", "stop"}


def test_settings_added_later_keep_the_other_fields_unset() -> None:
    """``with_settings`` (how the chat route adds its own settings) leaves unset fields open to server defaults."""
    params = SamplingParams(top_p=0.5).with_settings(skip_special_tokens=False, top_p=0.7)
    assert params.explicit_fields == {"top_p", "skip_special_tokens"}
    filled = params.with_defaults({"temperature": 0.0, "top_p": 0.9})
    assert (filled.temperature, filled.top_p, filled.skip_special_tokens) == (0.0, 0.7, False)
    with pytest.raises(ValueError, match="top_p"):
        params.with_settings(top_p=2.0)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.01}, "top_p must be in (0, 1]"),
        ({"top_k": -2}, "top_k must be 0 or -1"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be an integer"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"n": 0}, "n must be at least 1"),
        ({"logprobs": 21}, "logprobs must be between 0 and 20"),
        ({"logprobs": -1}, "logprobs must be between 0 and 20"),
        ({"prompt_logprobs": 21}, "prompt_logprobs must be between 0 and 20"),
        ({"seed": 2**63}, "seed must fit in a signed 64-bit integer"),
        ({"seed": -(2**63) - 1}, "seed must fit in a signed 64-bit integer"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 3}, "min_tokens (5) must not exceed max_tokens (3)"),
        ({"stop": ["ok", ""]}, "non-empty strings"),
        ({"stop": "x", "detokenize": False}, "stop strings need detokenize=True"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop_token_ids": 7}, "stop_token_ids a list of integers"),
        ({"stop_token_ids": [-1]}, "stop_token_ids must be >= 0"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids must be an integer"),
        ({"logit_bias": {"abc": 1.0}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {-3: 1.0}}, "non-negative token ids"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias value must be a finite number"),
        ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers"),
        ({"best_of": 2}, "unknown sampling parameter(s) ['best_of']"),
    ],
)
def test_validation_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"seed": 2**63 - 1},
        {"seed": -(2**63)},
        {"top_p": 1.0},
        {"top_p": 1e-6},
        {"logprobs": 20},
        {"logprobs": 0},
        {"prompt_logprobs": 20},
        {"presence_penalty": -2.0},
        {"frequency_penalty": 2.0},
        {"min_p": 1.0},
        {"min_tokens": 3, "max_tokens": 3},
        {"temperature": 0, "n": 3},
        {"top_k": 1},
    ],
)
def test_edges_accepted(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_check_vocab() -> None:
    SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99]).check_vocab(100)
    with pytest.raises(
        ValueError, match=r"logit_bias has token ids \[100\] outside the vocabulary \(size 100\)"
    ):
        SamplingParams(logit_bias={100: 1.0}).check_vocab(100)
    with pytest.raises(ValueError, match=r"stop_token_ids \[150\] are outside the vocabulary"):
        SamplingParams(stop_token_ids=[3, 150]).check_vocab(100)


def test_numpy_scalars_accepted() -> None:
    params = SamplingParams(
        temperature=np.float32(0.5), top_k=np.int64(3), logit_bias={np.int64(4): np.float64(2)}
    )
    assert (params.temperature, params.top_k, params.logit_bias) == (0.5, 3, {4: 2.0})
    assert type(params.top_k) is int and type(params.temperature) is float


def test_fields_set_after_construction_count_as_the_callers() -> None:
    """vLLM users change params after building them: such a field is explicit (server defaults do not replace
    it), None unsets it, and the engine's copy (``with_defaults``) is normalized and validated again."""
    params = SamplingParams(temperature=0.0)
    params.max_tokens = 3
    params.top_k = -1  # vLLM's "disabled"
    assert params.explicit_fields == {"temperature", "max_tokens", "top_k"}
    resolved = params.with_defaults({"temperature": 0.8, "max_tokens": 1638, "top_p": 0.9})
    assert (resolved.temperature, resolved.max_tokens, resolved.top_k, resolved.top_p) == (0.0, 3, 0, 0.9)
    params.temperature = None  # type: ignore[assignment]
    assert "temperature" not in params.explicit_fields and params.with_defaults({"temperature": 0.8}).temperature == 0.8
    params.top_p = 7.0
    with pytest.raises(ValueError, match="top_p"):
        params.with_defaults({})
