"""Model loading: resolve what the user named to local files, then build and fill the model."""

from candle_vllm.pyengine.loader.errors import ModelLoadError
from candle_vllm.pyengine.loader.load import LoadedModel, load_model
from candle_vllm.pyengine.loader.source import ModelSource, resolve_model_source

__all__ = ["LoadedModel", "ModelLoadError", "ModelSource", "load_model", "resolve_model_source"]
