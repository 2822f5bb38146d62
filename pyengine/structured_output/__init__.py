"""Structured output (contract S): constrained decoding with llguidance grammars as per-row token masks.

grammar.py    GrammarCompiler: schema -> validated grammar, cached per tokenizer by canonical JSON;
              check_structured_output (the request-time check: ValueError naming what is wrong)
matchers.py   GrammarMatchers: the runner's per-sequence matchers, their masks per step, advanced by samples
The mask itself is applied inside the batched sampler (``sampling/token_mask.py``), constrained rows only.
"""

from candle_vllm.pyengine.structured_output.grammar import (
    GrammarCompiler,
    check_structured_output,
    compiler_for,
)
from candle_vllm.pyengine.structured_output.matchers import GrammarMatchers

__all__ = ["GrammarCompiler", "GrammarMatchers", "check_structured_output", "compiler_for"]
