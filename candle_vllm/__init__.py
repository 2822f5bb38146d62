"""candle-vllm: LLM inference and serving engine with native CPU/CUDA kernels.

The offline API mirrors vLLM's: ``from candle_vllm import LLM, SamplingParams``.
"""

import os

# torch and the native kernels share one OpenMP runtime; spinning idle threads steal the cores the next parallel
# region needs whenever the machine is busy (measured: a 1536x576 Q4_1 GEMV took 8 ms spinning, 0.07 ms passive).
# Only effective when set before torch is first imported; an explicit user setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from candle_vllm.pyengine.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from candle_vllm.pyengine.llm import LLM, TextPrompt, TokensPrompt
from candle_vllm.pyengine.outputs import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    Logprob,
    RequestOutput,
)
from candle_vllm.pyengine.pooling_params import PoolingParams
from candle_vllm.pyengine.sampling import SamplingParams, StructuredOutputParams

__version__ = "0.1.0"

__all__ = ["LLM", "BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "CompletionOutput", "EmbeddingOutput", "EmbeddingRequestOutput", "Logprob", "PoolingParams",
           "RequestOutput", "SamplingParams", "StructuredOutputParams", "TextPrompt", "TokensPrompt", "__version__"]
