"""Tokenizers for the engine: HF tokenizer.json or GGUF vocabularies, chat templates, streaming decode.

- ``base``: the ``Tokenizer`` every other part uses (encode/decode, stop ids, chat template).
- ``hf``: load from a Hugging Face model directory.
- ``gguf_vocab`` + ``pretokenizers``: rebuild the tokenizer from GGUF metadata as llama.cpp reads it.
- ``chat_template``: transformers-compatible sandboxed Jinja rendering.
- ``detokenizer``: incremental, UTF-8-safe detokenization for streaming.
"""

from candle_vllm.pyengine.tokenizer.base import Tokenizer
from candle_vllm.pyengine.tokenizer.chat_template import ChatTemplateError
from candle_vllm.pyengine.tokenizer.detokenizer import IncrementalDetokenizer
from candle_vllm.pyengine.tokenizer.gguf_vocab import load_tokenizer_from_gguf
from candle_vllm.pyengine.tokenizer.hf import load_tokenizer_from_hf_dir

__all__ = [
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "load_tokenizer_from_gguf",
    "load_tokenizer_from_hf_dir",
]
