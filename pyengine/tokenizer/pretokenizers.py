"""Byte-level BPE pre-tokenizers for GGUF vocabularies, chosen by ``tokenizer.ggml.pre``.

A GGUF file keeps the BPE vocabulary and merges but not the pre-tokenizer; it only names it. llama.cpp
maps each name to a list of split regexes (``llama-vocab.cpp``) and applies them one after the other,
each one cutting every current piece into matches and the gaps between them. A ``tokenizers``
``Split(..., behavior="isolated")`` per regex does exactly that, and a final ``ByteLevel`` maps bytes to
the GPT-2 alphabet the vocabulary is written in. The regex strings are the public ones from the models'
own tokenizer.json files, as llama.cpp lists them.
"""

from __future__ import annotations

from tokenizers import Regex, pre_tokenizers

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Non-ASCII code points are written as \x{...} escapes so that no editor can silently normalise them.
_CASED_LETTERS = (
    r"A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}"
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}"
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}"
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}"
    r"\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}"
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}"
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}"
    r"\x{2139}\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}"
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}"
    r"\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}"
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}"
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}"
)
_CJK_HANGUL = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}]+"
_DEEPSEEK_LLM = [
    r"[\r\n]",
    r"\s?[" + _CASED_LETTERS + r"]+",
    r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3000}-\x{3002}]+",
    r"\s+$",
    _CJK_HANGUL,
    r"\p{N}+",
]
_DEEPSEEK_CODER = [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"]
_DEEPSEEK_V3 = [
    r"\p{N}{1,3}",
    r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
]
_BLOOM = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]

_GROUPS: list[tuple[tuple[str, ...], list[str]]] = [
    (("default",), _DEFAULT),
    (("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe", "chatglm-bpe"), [_LLAMA3]),
    (("qwen2", "stablelm2", "megrez", "hunyuan"), [_QWEN2]),
    (("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b"), [r"\p{N}", _GPT2]),
    (
        ("gpt-2", "gpt2", "phi-2", "mpt", "olmo", "jais", "gigachat", "roberta-bpe", "jina-es", "jina-de",
         "jina-v1-en", "jina-v2-es", "jina-v2-de", "jina-v2-code", "trillion"),
        [_GPT2],
    ),
    (("deepseek-llm",), _DEEPSEEK_LLM),
    (("deepseek-coder",), _DEEPSEEK_CODER),
    (("deepseek-v3",), _DEEPSEEK_V3),
    (("falcon",), [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]),
    (("tekken",), [_TEKKEN]),
    (("gpt-4o",), [_GPT4O]),
    (("poro-chat", "bloom", "gpt3-finnish"), [_BLOOM]),
    (("viking",), [_BLOOM, r"\p{N}"]),
]
SPLIT_REGEXES: dict[str, list[str]] = {name: regexes for names, regexes in _GROUPS for name in names}

# llama.cpp matches whole words against the vocabulary before merging for these (`ignore_merges`).
IGNORE_MERGES_PRE = frozenset({"llama3", "llama-v3", "llama-bpe", "falcon3", "tekken"})


def byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp uses for GGUF pre-tokenizer name ``pre`` (missing -> ``default``)."""
    name = pre or "default"
    regexes = SPLIT_REGEXES.get(name)
    if regexes is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre={name!r}; supported: "
            f"{', '.join(sorted(SPLIT_REGEXES))}. Load the model's tokenizer.json (HF directory) instead."
        )
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False) for regex in regexes
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)
