"""Server-side sampling defaults: what a request gets for the fields it did not set.

Precedence, highest first: the request's own fields, the server's CLI flags (``--temperature --top-p --top-k
--min-p --frequency-penalty --presence-penalty``), the model's generation_config.json, vLLM's defaults.
The Rust project let the CLI flags override generation_config.json in the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from candle_vllm.pyengine.sampling.params import SamplingParams

# generation_config.json keys a model author may set, by SamplingParams field (vLLM reads the same ones).
_GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class SamplingDefaults:
    """Default values for unset request fields; None leaves vLLM's own default in place."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any] | None) -> SamplingDefaults:
        """Read the sampling keys of a model's generation_config.json (other keys are ignored)."""
        config = config or {}
        return cls(**{key: config[key] for key in _GENERATION_CONFIG_KEYS if config.get(key) is not None})

    def overridden_by(self, other: SamplingDefaults) -> SamplingDefaults:
        """Layer ``other`` on top: its set values win (e.g. CLI flags over generation_config.json)."""
        return dataclasses.replace(
            self, **{k: v for k, v in dataclasses.asdict(other).items() if v is not None}
        )

    def apply(self, params: SamplingParams) -> SamplingParams:
        """A new copy of the request's params with every unset field that has a default here filled in,
        normalized and validated again (the caller may have changed fields since constructing it)."""
        fills = {name: value for name, value in dataclasses.asdict(self).items() if value is not None}
        return params.with_defaults(fills)
