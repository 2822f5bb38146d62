"""The pooling a checkpoint declares for its embeddings, which ``LLM.embed`` and ``/v1/embeddings`` must honour.

The engine pools the last token (decoder embedding models: Qwen3-Embedding, gte-Qwen2, e5-mistral). A checkpoint
that says otherwise (a GGUF's ``<arch>.pooling_type``, llama.cpp's enum; a sentence-transformers ``modules.json``
with its Pooling module's config, or a Dense projection after it) gets its embedding requests refused with the
reason, not vectors pooled another way than the model was trained for. ``Matryoshka`` is the other declaration an
embedding request depends on: which truncated sizes (``dimensions``) the vectors were trained for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from candle_vllm.pyengine.loader.source import ModelSource

# llama.cpp's enum llama_pooling_type (0 none: the file names no pooling).
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
# sentence-transformers' Pooling config keys, in the order it applies them.
_ST_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
             "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len", "pooling_mode_weightedmean_tokens": "weightedmean",
             "pooling_mode_lasttoken": "last"}


def declared_pooling(source: ModelSource, gguf_metadata: Mapping[str, Any] | None) -> str | None:
    """The pooling the checkpoint names ("last", "mean", "cls", ...), or None where it names none."""
    if gguf_metadata is not None:
        arch = gguf_metadata.get("general.architecture")
        code = gguf_metadata.get(f"{arch}.pooling_type")
        return None if code is None else _GGUF_POOLING.get(int(code))
    if source.config_dir is None:
        return None
    try:
        modules = json.loads((source.config_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    pooling: str | None = None
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        if kind.endswith("models.Pooling"):
            try:
                cfg = json.loads((source.config_dir / str(module.get("path", "")) / "config.json").read_text())
            except (OSError, ValueError):
                return None
            modes = [name for key, name in _ST_MODES.items() if cfg.get(key)]
            pooling = "+".join(modes) if modes else None
        elif kind.endswith("models.Dense"):  # a projection after the pooling: other vectors than the pooled ones
            return f"{pooling or 'unknown'} + a Dense projection"
    return pooling


def check_last_token_pooling(pooling: str | None) -> None:
    """Refuse embeddings for a checkpoint that declares another pooling than the engine's last-token one."""
    if pooling not in (None, "last"):
        raise ValueError(f"this model declares {pooling} pooling for its embeddings, and the engine pools the last "
                         "token only; embed with a server that implements that pooling")


@dataclass(frozen=True)
class Matryoshka:
    """Whether a checkpoint's embeddings were trained to be truncated (Matryoshka representation learning), read
    as vLLM reads it: ``is_matryoshka`` or ``matryoshka_dimensions`` in config.json (or ``--hf-overrides``).

    Cutting a vector the model was not trained to cut gives poor embeddings that look fine, so a ``dimensions``
    request is refused for other models, as vLLM refuses it, instead of answering with such a vector."""

    supported: bool = False
    dimensions: tuple[int, ...] | None = None  # the sizes it was trained for; None: any size

    @classmethod
    def of_config(cls, raw: Mapping[str, Any]) -> Matryoshka:
        """The checkpoint's declaration; a malformed ``matryoshka_dimensions`` is a ValueError."""
        dims = raw.get("matryoshka_dimensions")
        if dims is not None:
            if not isinstance(dims, list) or not dims or not all(
                    isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in dims):
                raise ValueError(f"matryoshka_dimensions must be a list of positive integers, got {dims!r}")
            return cls(True, tuple(dims))
        return cls(bool(raw.get("is_matryoshka", False)))

    def check(self, model: str, dimensions: int) -> None:
        """Refuse ``dimensions`` (vLLM's messages) unless the model was trained for vectors of that size."""
        if not self.supported:
            raise ValueError(f'Model "{model}" does not support matryoshka representation, changing output '
                             "dimensions will lead to poor results. If it was trained for it, declare it with "
                             "--hf-overrides '{\"is_matryoshka\": true}'")
        if self.dimensions is not None and dimensions not in self.dimensions:
            raise ValueError(f'Model "{model}" only supports {list(self.dimensions)} matryoshka dimensions, use '
                             "other output dimensions will lead to poor results.")


def truncated(vector: list[float], dimensions: int | None) -> list[float]:
    """The first ``dimensions`` components of an L2-normalised vector, normalised again (the whole vector when
    ``dimensions`` is None)."""
    if dimensions is None or dimensions >= len(vector):
        return vector
    head = vector[:dimensions]
    norm = math.sqrt(math.fsum(x * x for x in head))
    return [x / max(norm, 1e-12) for x in head]
