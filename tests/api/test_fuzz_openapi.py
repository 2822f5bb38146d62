"""Fuzzing from ``/openapi.json`` with schemathesis: valid and invalid bodies for every operation must never
give a 5xx, and every error must have OpenAI's shape. Runs against the fake engine so examples are cheap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from candle_vllm.api.openapi import openapi_document
from candle_vllm.api.state import ServerConfig
from tests.api.conftest import ServerThread, engine_cm, running, tcp_bind
from tests.api.fake_engine import FakeEngine

schema = schemathesis.openapi.from_dict(openapi_document())


@pytest.fixture(scope="module")
def fuzz_server(smol_tokenizer) -> Iterator[ServerThread]:
    engine = FakeEngine(smol_tokenizer, max_model_len=256)
    with running(engine_cm(engine), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_5xx_and_openai_errors(case: schemathesis.Case, fuzz_server: ServerThread) -> None:
    response = case.call(base_url=fuzz_server.urls[0], timeout=30)
    assert response.status_code < 500, (case.body, response.text[:500])
    if response.status_code >= 400:
        err = response.json()["error"]
        assert isinstance(err["message"], str) and err["message"]
        assert isinstance(err["type"], str)
        assert set(err) == {"message", "type", "param", "code"}
    elif case.path == "/v1/chat/completions" and isinstance(case.body, dict) and case.body.get("stream"):
        assert response.text.endswith("data: [DONE]\n\n")
