"""Sampling (contract E): per-request ``SamplingParams``, server defaults, and the batched ``Sampler``.

params.py     SamplingParams: vLLM's fields, defaults and validation; tracks explicitly set fields;
              StructuredOutputParams (the grammar a request's output must follow)
defaults.py   SamplingDefaults: CLI flags / generation_config.json for the fields a request left unset
batch.py      SamplingBatch: one step's per-row parameters as tensors (+ make_generator for seeded requests)
penalties.py  allowed_token_ids, logit_bias, bans (min_tokens, bad words), repetition / frequency / presence
              penalties
bad_words.py  vLLM's bad_words: the token sequences a word bans, and which token each bans after the output
filters.py    top-k, top-p, min-p truncation
logprobs.py   raw logprobs of chosen tokens with top-k alternatives and ranks; prompt logprobs
token_mask.py TokenMask: grammar masks of structured-output rows, applied first (constrained rows only)
sampler.py    Sampler: the whole pipeline for one step
"""

from candle_vllm.pyengine.sampling.batch import SamplingBatch, SamplingRow, make_generator
from candle_vllm.pyengine.sampling.defaults import SamplingDefaults
from candle_vllm.pyengine.sampling.logprobs import LogprobsTensors, compute_logprobs, prompt_logprobs
from candle_vllm.pyengine.sampling.params import MAX_LOGPROBS, SamplingParams, StructuredOutputParams
from candle_vllm.pyengine.sampling.sampler import Sampler, SamplerOutput

__all__ = [
    "MAX_LOGPROBS",
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingBatch",
    "SamplingDefaults",
    "SamplingParams",
    "SamplingRow",
    "StructuredOutputParams",
    "compute_logprobs",
    "make_generator",
    "prompt_logprobs",
]
