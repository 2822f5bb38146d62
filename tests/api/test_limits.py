"""Token limits: ``TokenLimits`` on its own, then the official client against a real server (embedded SmolLM2)
whose KV cache holds far fewer tokens than its default ``max_tokens`` (``--max-gen-tokens``, a fifth of the
context): a request that sets no ``max_tokens`` must run, one whose ``max_tokens`` cannot fit must be a 400."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.errors import APIError
from candle_vllm.api.limits import TokenLimits
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind


def test_default_is_clamped_to_the_kv_cache_and_the_context() -> None:
    limits = TokenLimits(max_model_len=100, kv_capacity_tokens=40, default_max_tokens=20)
    assert limits.resolve(5, None) == 20  # the default fits
    assert limits.resolve(30, None) == 11  # 30 prompt + 11 generated - 1 never fed back = the 40 cached tokens
    assert limits.resolve(40, None) == 1
    assert TokenLimits(100, None, 20).resolve(90, None) == 10  # the context
    assert TokenLimits(100, None, None).resolve(5, None) is None  # nothing known: the engine's own default


def test_limits_that_cannot_fit_are_400s_naming_the_parameter() -> None:
    limits = TokenLimits(max_model_len=100, kv_capacity_tokens=40, default_max_tokens=20)
    assert limits.resolve(30, 11) == 11
    with pytest.raises(APIError) as info:
        limits.resolve(30, 12)
    assert (info.value.status, info.value.param) == (400, "max_tokens") and "at most 11" in info.value.message
    with pytest.raises(APIError) as info:
        limits.resolve(41, None)
    assert info.value.param == "input_tokens" and "KV cache holds 40 tokens" in info.value.message
    with pytest.raises(APIError) as info:
        limits.resolve(100, None)
    assert info.value.param == "input_tokens"
    with pytest.raises(APIError) as info:
        TokenLimits(100, None, None).resolve(90, 11)
    assert info.value.param == "max_tokens"


@pytest.fixture(scope="module")
def small_kv() -> Iterator[ServerThread]:
    args = EngineArgs(model=str(smollm2_path()), mem=2, block_size=16, max_num_seqs=4)
    with running(lambda: open_engine(args), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


def test_unset_max_tokens_runs_as_far_as_the_kv_cache_allows(small_kv: ServerThread) -> None:
    capacity = small_kv.engine.info.kv_capacity_tokens
    assert small_kv.engine.core.max_gen_tokens > capacity, "the default alone must not fit"
    client = small_kv.openai()
    model = client.models.list().data[0].id
    r = client.completions.create(model=model, prompt="Hello there", temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == capacity - r.usage.prompt_tokens + 1

    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}],
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True}))
    usage = chunks[-1].usage
    assert usage.prompt_tokens + usage.completion_tokens - 1 == capacity

    with pytest.raises(openai.BadRequestError, match="lower max_tokens") as info:
        client.completions.create(model=model, prompt="Hello there", max_tokens=capacity)
    assert info.value.body["param"] == "max_tokens"
