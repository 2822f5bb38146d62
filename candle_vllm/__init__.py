"""candle-vllm: LLM inference and serving engine with native CPU/CUDA kernels."""

__version__ = "0.1.0"
