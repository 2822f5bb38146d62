"""Load the tokenizer of a Hugging Face model directory the way transformers' AutoTokenizer reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as HFTokenizer

from candle_vllm.pyengine.tokenizer.base import Tokenizer

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot read JSON ({e})") from e
    return data if isinstance(data, dict) else {}


def _token_text(value: Any) -> str | None:
    """A special token given as a string or as a serialized AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named chat templates: tokenizer_config's ``chat_template`` (a string or a list of {name, template}),
    overridden by ``chat_template.jinja`` (or legacy ``chat_template.json``), plus
    ``additional_chat_templates/<name>.jinja``."""
    templates: dict[str, str] = {}
    configured = config.get("chat_template")
    if isinstance(configured, str):
        templates["default"] = configured
    elif isinstance(configured, list):
        templates.update({t["name"]: t["template"] for t in configured if "name" in t and "template" in t})
    legacy = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(legacy, str):
        templates["default"] = legacy
    if (path / "chat_template.jinja").is_file():
        templates["default"] = (path / "chat_template.jinja").read_text(encoding="utf-8")
    extra = path / "additional_chat_templates"
    if extra.is_dir():
        for f in sorted(extra.glob("*.jinja")):
            templates[f.stem] = f.read_text(encoding="utf-8")
    return templates


def _generation_eos_ids(path: Path) -> list[int]:
    eos = _read_json(path / "generation_config.json").get("eos_token_id")
    if isinstance(eos, int):
        return [eos]
    return [i for i in eos if isinstance(i, int)] if isinstance(eos, list) else []


def _rebuild_post_processor(hf: HFTokenizer, config: dict[str, Any], names: dict[str, str]) -> None:
    """tokenizer.json's post-processor decides what encode adds, as in AutoTokenizer. Only when it has
    none do tokenizer_config's add_bos_token / add_eos_token apply (transformers' Llama-family classes
    honour them; its generic class ignores them, which would silently drop a BOS the model expects)."""
    if hf.post_processor is not None:
        return
    pieces: list[str] = ["$A"]
    specials: list[tuple[str, int]] = []
    for flag, name, at_end in (("add_bos_token", "bos_token", False), ("add_eos_token", "eos_token", True)):
        text = names.get(name)
        token_id = hf.token_to_id(text) if text is not None else None
        if config.get(flag) and text is not None and token_id is not None:
            pieces.insert(len(pieces) if at_end else 0, text)
            specials.append((text, token_id))
    hf.post_processor = processors.TemplateProcessing(single=pieces, pair=[*pieces, "$B"], special_tokens=specials)


def load_tokenizer_from_hf_dir(path: Path | str) -> Tokenizer:
    """The engine tokenizer of a model directory holding tokenizer.json (+ tokenizer_config.json,
    chat_template.jinja, generation_config.json when present)."""
    path = Path(path)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(
            f"{path}: no tokenizer.json; only fast (tokenizers) tokenizers are supported. Convert it once with "
            "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
        )
    hf = HFTokenizer.from_file(str(tokenizer_file))
    config = {**_read_json(path / "special_tokens_map.json"), **_read_json(path / "tokenizer_config.json")}
    names = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name))) is not None}
    # transformers registers every named special token as special in the backend (it is hidden on decode).
    already = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
    hf.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in names.values()
                           if text not in already and hf.token_to_id(text) is not None])
    _rebuild_post_processor(hf, config, names)

    def token_id(name: str) -> int | None:
        return hf.token_to_id(names[name]) if name in names else None

    return Tokenizer(
        hf,
        bos_token_id=token_id("bos_token"),
        eos_token_id=token_id("eos_token"),
        pad_token_id=token_id("pad_token"),
        extra_stop_token_ids=_generation_eos_ids(path),
        special_tokens=names,
        chat_templates=read_chat_templates(path, config),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces"))
        and type(hf.model).__name__ != "BPE",
    )
