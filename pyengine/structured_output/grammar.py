"""Grammars for structured output, compiled with llguidance once per distinct schema and tokenizer.

A request's ``StructuredOutputParams`` becomes a JSON-schema grammar (``json_object`` is the schema
``{"type": "object"}``). Compiling checks the schema (unknown types, unimplemented keywords, unsatisfiable
constraints, bad regexes) and yields a template matcher; every sequence gets a cheap deep copy of it. The
engine's admission check and the runner share one compiler per tokenizer, so a schema is compiled once, not
again when its request starts or for each of its ``n`` sequences. The schema checks themselves need no
tokenizer: the HTTP layer runs them (cached) before a request reaches the engine.
"""

from __future__ import annotations

import functools
import json
import threading
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import llguidance

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

from candle_vllm.pyengine.sampling.params import StructuredOutputParams
from candle_vllm.pyengine.tokenizer import Tokenizer

# Compact JSON (no whitespace between tokens) unless a schema's "x-guidance" says otherwise: with free
# whitespace a sampling model can emit blank lines until max_tokens and never close the object.
JSON_DEFAULTS: JsonCompileOptions = {"whitespace_flexible": False}
ANY_JSON_OBJECT: dict[str, Any] = {"type": "object"}
MAX_CACHED_GRAMMARS = 256
_UNUSABLE = "the JSON schema cannot be used for structured output"


def grammar_key(params: StructuredOutputParams) -> str:
    """Compact JSON of the schema the params stand for: equal schemas share one compiled grammar. Key order is
    kept, not sorted: a schema's property order is the order the output writes them in (OpenAI's structured
    outputs; "reasoning" before "answer" schemas rely on it)."""
    schema = ANY_JSON_OBJECT if params.json_object else params.json_schema
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


class GrammarCompiler:
    """Compiles and caches (LRU, ``max_cached`` schemas) the grammars of one tokenizer; thread-safe.

    The llguidance view of the vocabulary is built on first use (about 0.2 s for 49k tokens), so engines that
    never see a constrained request pay nothing. The model's stop tokens are the grammar's EOS tokens: a row
    whose grammar is complete may end with any of them.
    """

    def __init__(self, tokenizer: Tokenizer, max_cached: int = MAX_CACHED_GRAMMARS) -> None:
        self._tokenizer = tokenizer
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                tok = self._tokenizer
                eos = sorted(tok.stop_token_ids, key=lambda t: (t != tok.eos_token_id, t))
                self._ll_tokenizer = llguidance.LLTokenizer(tok.hf.to_str(), n_vocab=tok.vocab_size,
                                                            eos_token=eos or None)
            return self._ll_tokenizer

    @property
    def mask_words(self) -> int:
        """int32 words per packed token mask."""
        return (self.ll_tokenizer.vocab_size + 31) // 32

    def new_matcher(self, params: StructuredOutputParams) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (start state). Raises ValueError for an unusable schema."""
        key = grammar_key(params)
        with self._lock:
            template = self._templates.get(key)
            if template is not None:
                self._templates.move_to_end(key)
                return template.deep_copy()
        template = self._compile(key)
        with self._lock:
            self._templates[key] = template
            while len(self._templates) > self._max_cached:
                self._templates.popitem(last=False)
            return template.deep_copy()

    def _compile(self, key: str) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar_of(key), log_level=0)
        if matcher.is_error():
            raise ValueError(f"{_UNUSABLE}: {matcher.get_error()}")
        return matcher


@functools.lru_cache(maxsize=MAX_CACHED_GRAMMARS)
def _checked_grammar(key: str) -> tuple[str, str | None]:
    """(llguidance grammar, error or None) of a canonical schema; the checks need no tokenizer."""
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(key, defaults=JSON_DEFAULTS)
    except ValueError as exc:
        return "", str(exc)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    return grammar, messages[0] if is_error else None


def grammar_of(key: str) -> str:
    """The llguidance grammar of a canonical schema (``grammar_key``); ValueError naming what is wrong."""
    grammar, error = _checked_grammar(key)
    if error is not None:
        raise ValueError(f"{_UNUSABLE}: {error}; fix or simplify the schema")
    return grammar


_compilers: weakref.WeakKeyDictionary[Tokenizer, GrammarCompiler] = weakref.WeakKeyDictionary()
_compilers_lock = threading.Lock()


def compiler_for(tokenizer: Tokenizer) -> GrammarCompiler:
    """The one compiler (and grammar cache) of ``tokenizer``, shared by the request check and the runner."""
    with _compilers_lock:
        compiler = _compilers.get(tokenizer)
        if compiler is None:
            compiler = _compilers[tokenizer] = GrammarCompiler(tokenizer)
        return compiler


def check_structured_output(params: StructuredOutputParams, tokenizer: Tokenizer | None) -> None:
    """Compile (and cache) the grammar of ``params``; ValueError naming what is wrong with the schema
    (unknown types or formats, unimplemented keywords, unsatisfiable constraints, bad regexes, dangling $ref).

    With ``tokenizer=None`` only the schema checks run (they need no vocabulary): the HTTP layer's early
    check; the engine runs the full one when it admits the request.
    """
    if tokenizer is None:
        grammar_of(grammar_key(params))
    else:
        compiler_for(tokenizer).new_matcher(params)
