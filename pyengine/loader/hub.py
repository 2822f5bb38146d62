"""Hugging Face Hub resolution: the local cache first, a download (with progress bars) only when needed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import huggingface_hub
from huggingface_hub.errors import GatedRepoError, HFValidationError, RepositoryNotFoundError
from huggingface_hub.utils import validate_repo_id

from candle_vllm.pyengine.loader.errors import ModelLoadError
from candle_vllm.pyengine.loader.gguf_shards import pick_gguf, shard_names
from candle_vllm.pyengine.loader.source import ModelSource, source_from_dir

CONFIG_PATTERNS = ["*.json", "*.jinja", "tokenizer.model", "*.tiktoken"]
T = TypeVar("T")


def _cached_then_online(repo_id: str, fetch: Callable[[bool], T]) -> T:
    """``fetch(local_files_only)`` from the cache, else online; network failures become one clear line."""
    try:
        return fetch(True)
    except Exception:
        pass
    try:
        return fetch(False)
    except RepositoryNotFoundError as e:
        raise ModelLoadError(f"{repo_id}: no such Hugging Face repo (or it is private: pass --hf-token)") from e
    except GatedRepoError as e:
        raise ModelLoadError(f"{repo_id}: gated repo; accept its license on huggingface.co and pass --hf-token") from e
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(
            f"{repo_id}: not in the local Hugging Face cache and the Hub is unreachable ({type(e).__name__}); "
            "connect to the internet, point HF_HOME at a cache that holds it, or pass a local path"
        ) from e


def resolve_hub(repo_id: str, weight_file: str | None, token: str | None, load_format: str) -> ModelSource:
    """Fetch a Hub model: safetensors repo, ``--f file.gguf`` (with its split shards) or ``--f subfolder``."""
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise ModelLoadError(f"{repo_id}: neither a local path nor a valid Hugging Face repo id") from e
    if weight_file is not None and weight_file.endswith(".gguf"):
        def download(name: str) -> Path:
            return Path(_cached_then_online(repo_id, lambda local: huggingface_hub.hf_hub_download(
                repo_id, name, token=token, local_files_only=local)))

        files = [download(n) for n in shard_names(weight_file)]
        return ModelSource(repo_id, "gguf", tuple(files), None)
    if weight_file is not None:
        sub = weight_file.strip("/")
        snap = Path(_cached_then_online(repo_id, lambda local: huggingface_hub.snapshot_download(
            repo_id, allow_patterns=[f"{sub}/*.gguf"], token=token, local_files_only=local)))
        return ModelSource(repo_id, "gguf", tuple(pick_gguf((snap / sub).glob("*.gguf"), f"{repo_id}/{sub}")), None)
    patterns = CONFIG_PATTERNS if load_format == "dummy" else [*CONFIG_PATTERNS, "*.safetensors"]

    def fetch(local: bool) -> ModelSource:
        snap = Path(huggingface_hub.snapshot_download(
            repo_id, allow_patterns=patterns, token=token, local_files_only=local))
        if not (snap / "config.json").is_file():
            if local:
                raise FileNotFoundError(f"{repo_id}: no cached config.json")
            ggufs = [f for f in huggingface_hub.list_repo_files(repo_id, token=token) if f.endswith(".gguf")]
            if ggufs:
                raise ModelLoadError(f"{repo_id}: a GGUF repo; pick a file with --f (e.g. {', '.join(ggufs[:4])})")
            raise ModelLoadError(f"{repo_id}: the repo has no config.json, so it is not a transformers model")
        return source_from_dir(snap, repo_id, "dummy" if load_format == "dummy" else "safetensors")

    return _cached_then_online(repo_id, fetch)
