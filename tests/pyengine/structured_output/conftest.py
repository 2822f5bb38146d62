"""The SmolLM2 tokenizer (from the embedded GGUF) for the grammar tests: a real 49k BPE vocabulary."""

from __future__ import annotations

import pytest

from candle_vllm.pyengine.tokenizer import Tokenizer, load_tokenizer_from_gguf
from tests.api.conftest import smollm2_path


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer_from_gguf(smollm2_path())
