"""Rebuild a model's tokenizer from the vocabulary stored in GGUF metadata.

A GGUF file carries tokens, token types, scores or merges and a few flags, not a tokenizer.json. We
turn them into a ``tokenizers.Tokenizer`` that tokenizes like llama.cpp does on the same file:

- ``gpt2`` (byte-level BPE): the stored merges, the pre-tokenizer named by ``tokenizer.ggml.pre``
  (see ``pretokenizers``), byte-level decoding.
- ``llama`` (SentencePiece BPE): llama.cpp merges adjacent pieces by the score of the merged piece,
  which is BPE with merges ranked by that score; characters outside the vocabulary fall back to
  ``<0xXX>`` byte tokens; spaces become U+2581 and, with ``add_space_prefix``, one is put in front of
  the text and after every special token (a ``Prepend`` normalizer runs per text segment).
- control and unknown tokens become special added tokens, user-defined ones plain added tokens, so
  they are matched whole in text (llama.cpp with parse_special) and control ones are hidden on decode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
from gguf import TokenType
from tokenizers import AddedToken, decoders, models, normalizers, processors
from tokenizers import Tokenizer as HFTokenizer

from candle_vllm.pyengine.tokenizer.base import Tokenizer
from candle_vllm.pyengine.tokenizer.pretokenizers import IGNORE_MERGES_PRE, byte_level_pre_tokenizer

_SPACE = "\u2581"
# Tokens llama.cpp ends generation on by their text (llama-vocab.cpp), besides the eos / eot / eom ids; DeepSeek's
# end of sentence is its auto-detected eot.
_EOG_TEXTS = frozenset(
    {"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
     "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>",
     "<\uff5cend\u2581of\u2581sentence\uff5c>"}
)
# The fill-in-the-middle pad, repository and file-separator tokens end generation in llama.cpp too: the file's id
# for each kind, else a token with one of these texts (llama.cpp takes the first it meets in a hash map's order;
# the lowest id here).
_FIM_EOG_TEXTS = {
    "fim_pad": ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>"),
    "fim_rep": ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    "fim_sep": ("<|file_sep|>",),
}
# o200k_harmony (gpt-oss) ends on <|return|> and <|call|>: there <|end|> only closes a message, so llama.cpp drops it.
_HARMONY_ENDS = ("<|return|>", "<|call|>")
_SPECIAL_ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "pad": "tokenizer.ggml.padding_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
    "fim_pad": "tokenizer.ggml.fim_pad_token_id",
    "fim_rep": "tokenizer.ggml.fim_rep_token_id",
    "fim_sep": "tokenizer.ggml.fim_sep_token_id",
}


@dataclass
class GGUFVocab:
    """The tokenizer metadata of one GGUF file, with llama.cpp's defaults applied."""

    model: str
    pre: str | None
    tokens: list[str]
    token_types: list[int]
    scores: list[float] | None
    merges: list[str] | None
    special_ids: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_templates: dict[str, str] = field(default_factory=dict)


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    f = reader.get_field(key)
    return None if f is None else f.contents()


def read_gguf_vocab(reader: gguf.GGUFReader) -> GGUFVocab:
    """Collect the tokenizer fields of an opened GGUF file."""
    model = _field(reader, "tokenizer.ggml.model")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
        raise ValueError("the GGUF file has no tokenizer (tokenizer.ggml.model / tokens missing); pass a tokenizer")
    if model not in ("gpt2", "llama"):
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r} (supported: 'gpt2' byte-level BPE, 'llama' "
            "SentencePiece); load the model's tokenizer.json instead"
        )
    pre = _field(reader, "tokenizer.ggml.pre")
    token_types = _field(reader, "tokenizer.ggml.token_type") or [int(TokenType.NORMAL)] * len(tokens)
    scores = _field(reader, "tokenizer.ggml.scores")
    if len(token_types) != len(tokens) or (scores is not None and len(scores) != len(tokens)):
        raise ValueError("GGUF tokenizer arrays disagree in length (tokens / token_type / scores); the file is corrupt")
    special_ids: dict[str, int] = {"bos": 1, "eos": 2, "unk": 0} if model == "llama" else {}
    for name, key in _SPECIAL_ID_KEYS.items():
        value = _field(reader, key)
        if value is not None and 0 <= int(value) < len(tokens):
            special_ids[name] = int(value)
    if model == "llama":
        add_bos, add_space_prefix = True, True
    else:
        add_bos, add_space_prefix = pre in IGNORE_MERGES_PRE or pre == "chameleon", False
    flags = {
        name: _field(reader, f"tokenizer.ggml.{name}")
        for name in ("add_bos_token", "add_eos_token", "add_space_prefix")
    }
    templates = {"default": t} if (t := _field(reader, "tokenizer.chat_template")) else {}
    for name in _field(reader, "tokenizer.chat_templates") or []:
        if (t := _field(reader, f"tokenizer.chat_template.{name}")) is not None:
            templates[name] = t
    return GGUFVocab(
        model=model,
        pre=pre,
        tokens=list(tokens),
        token_types=[int(t) for t in token_types],
        scores=scores,
        merges=_field(reader, "tokenizer.ggml.merges"),
        special_ids=special_ids,
        add_bos=add_bos if flags["add_bos_token"] is None else bool(flags["add_bos_token"]),
        add_eos=bool(flags["add_eos_token"]),
        add_space_prefix=add_space_prefix if flags["add_space_prefix"] is None else bool(flags["add_space_prefix"]),
        chat_templates=templates,
    )


def _split_merge(merge: str) -> tuple[str, str] | None:
    cut = merge.find(" ", 1)  # as llama.cpp: a piece may start with a space
    return None if cut < 0 else (merge[:cut], merge[cut + 1 :])


def _byte_level_model(v: GGUFVocab, vocab: dict[str, int]) -> models.Model:
    if v.merges is None:
        raise ValueError("GGUF gpt2 tokenizer without tokenizer.ggml.merges; the file is incomplete")
    merges = []
    for merge in v.merges:
        pair = _split_merge(merge)
        if pair and pair[0] in vocab and pair[1] in vocab and pair[0] + pair[1] in vocab:
            merges.append(pair)
    return models.BPE(vocab=vocab, merges=merges, ignore_merges=v.pre in IGNORE_MERGES_PRE)


def _sentencepiece_model(v: GGUFVocab, vocab: dict[str, int]) -> models.Model:
    scores = v.scores or [0.0] * len(v.tokens)
    candidates: list[tuple[float, int, int, str, str]] = []
    for i, (text, kind) in enumerate(zip(v.tokens, v.token_types, strict=True)):
        if kind in (TokenType.CONTROL, TokenType.BYTE) or vocab.get(text) != i:
            continue
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                candidates.append((-scores[i], i, cut, left, right))
    candidates.sort()
    unk_id = v.special_ids.get("unk")
    return models.BPE(
        vocab=vocab,
        merges=[(left, right) for *_, left, right in candidates],
        unk_token=v.tokens[unk_id] if unk_id is not None else None,
        fuse_unk=True,
        byte_fallback=True,
    )


def eog_token_ids(v: GGUFVocab) -> set[int]:
    """The ids llama.cpp ends generation on for this vocabulary: eos / eot / eom, the tokens of ``_EOG_TEXTS``,
    the fill-in-the-middle pad / repository / separator tokens (``_FIM_EOG_TEXTS``), without harmony's <|end|>."""
    ids = v.special_ids
    eog = {ids[k] for k in ("eos", "eot", "eom") if k in ids}
    eog |= {i for i, text in enumerate(v.tokens) if text in _EOG_TEXTS}
    for kind, texts in _FIM_EOG_TEXTS.items():
        found = ids.get(kind)
        if found is None:
            found = next((i for i, text in enumerate(v.tokens) if text in texts), None)
        if found is not None:
            eog.add(found)
    present = set(v.tokens)
    if all(t in present for t in _HARMONY_ENDS) and "<|end|>" in present:
        eog.discard(v.tokens.index("<|end|>"))
    return eog


def build_hf_tokenizer(v: GGUFVocab, control_ids: set[int] | frozenset[int] = frozenset()) -> HFTokenizer:
    """A ``tokenizers.Tokenizer`` equivalent to llama.cpp's tokenizer for this vocabulary; ``control_ids`` (the
    end-of-generation tokens) are special whatever their type, as llama.cpp makes them."""
    vocab = {text: i for i, text in enumerate(v.tokens)}  # a repeated text maps to its last id, as in llama.cpp
    if v.model == "gpt2":
        tok = HFTokenizer(_byte_level_model(v, vocab))
        tok.pre_tokenizer = byte_level_pre_tokenizer(v.pre)
        tok.decoder = decoders.ByteLevel()
    else:
        tok = HFTokenizer(_sentencepiece_model(v, vocab))
        escape = normalizers.Replace(" ", _SPACE)
        tok.normalizer = normalizers.Sequence([normalizers.Prepend(_SPACE), escape]) if v.add_space_prefix else escape
        steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
        if v.add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
        tok.decoder = decoders.Sequence(steps)
    added = []
    for i, (text, kind) in enumerate(zip(v.tokens, v.token_types, strict=True)):
        control = i in control_ids
        if (kind in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED) or control) and vocab[text] == i:
            special = kind != TokenType.USER_DEFINED or control
            added.append(AddedToken(text, special=special, normalized=False))
    tok.add_special_tokens([t for t in added if t.special])
    tok.add_tokens([t for t in added if not t.special])
    tok.post_processor = _bos_eos_processor(v)
    return tok


def _bos_eos_processor(v: GGUFVocab) -> processors.PostProcessor:
    bos, eos = v.special_ids.get("bos"), v.special_ids.get("eos")
    pieces, specials = ["$A"], []
    if v.add_bos and bos is not None:
        pieces.insert(0, v.tokens[bos])
        specials.append((v.tokens[bos], bos))
    if v.add_eos and eos is not None:
        pieces.append(v.tokens[eos])
        specials.append((v.tokens[eos], eos))
    return processors.TemplateProcessing(single=pieces, pair=[*pieces, "$B"], special_tokens=specials)


def load_tokenizer_from_gguf(path: Path | str | gguf.GGUFReader) -> Tokenizer:
    """The engine tokenizer of a GGUF model (a path, or an already opened ``GGUFReader``)."""
    reader = path if isinstance(path, gguf.GGUFReader) else gguf.GGUFReader(str(path))
    v = read_gguf_vocab(reader)
    ids = v.special_ids
    eog = eog_token_ids(v)
    names = {"bos": "bos_token", "eos": "eos_token", "unk": "unk_token", "pad": "pad_token", "sep": "sep_token",
             "mask": "mask_token"}
    return Tokenizer(
        build_hf_tokenizer(v, eog),
        bos_token_id=ids.get("bos"),
        eos_token_id=ids.get("eos"),
        pad_token_id=ids.get("pad"),
        extra_stop_token_ids=eog,
        special_tokens={name: v.tokens[ids[key]] for key, name in names.items() if key in ids},
        chat_templates=v.chat_templates,
    )
