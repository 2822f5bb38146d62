"""candle-vllm: LLM inference and serving engine with native CPU/CUDA kernels.

The offline API mirrors vLLM's: ``from candle_vllm import LLM, SamplingParams``.
"""

from candle_vllm.pyengine.llm import LLM
from candle_vllm.pyengine.outputs import CompletionOutput, Logprob, RequestOutput
from candle_vllm.pyengine.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
