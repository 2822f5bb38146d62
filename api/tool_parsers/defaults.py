"""Which tool-call parser a model gets when ``--enforce-parser`` does not choose one.

The model family decides first (architecture and model name: Qwen3-Coder and Qwen3.5+ write XML calls,
older Qwen Hermes JSON, Mistral ``[TOOL_CALLS]``, Llama 3.x JSON, Gemma bare JSON); a model of an unknown
family is judged by what its chat template teaches (``<function=`` / ``<tool_call>`` / ``[TOOL_CALLS]`` /
``<|python_tag|>``). None when nothing says.
"""

from __future__ import annotations

import re

# Qwen3-Coder, Qwen3.5+ and later generations (not "qwen-14b", a size)
_QWEN_XML_NAME = re.compile(r"qwen[-_ ]?3[-_ ]?coder|qwen[-_ ]?3[._](?:[5-9]|\d\d)|qwen[-_ ]?[4-9](?:\.\d+)?(?![\db])")
_LLAMA3_NAME = re.compile(r"llama[-_ ]?3")


def default_parser_name(architecture: str, model_name: str, chat_template: str | None) -> str | None:
    """The parser for a model: ``architecture`` is the HF ``architectures[0]`` or GGUF
    ``general.architecture``; ``model_name`` the model id, path or GGUF name; both are matched loosely."""
    arch, name = architecture.lower(), model_name.lower()
    template = chat_template or ""
    if "qwen" in arch or "qwen" in name:
        if _QWEN_XML_NAME.search(name) or re.search(r"qwen3_?[5-9]", arch) or _teaches_xml(template):
            return "qwen_coder"
        if "qwen2" in arch or "qwen3" in arch or re.search(r"qwen[-_ ]?[23]", name):
            return "qwen"
    if any(k in arch or k in name for k in ("mistral", "mixtral", "ministral", "devstral", "magistral")):
        return "mistral"
    if "llama" in arch and _LLAMA3_NAME.search(name):
        return "llama3"
    if "gemma" in arch or "gemma" in name:
        return "json"
    return _from_template(template)


def _teaches_xml(template: str) -> bool:
    return "<function=" in template and "<parameter=" in template


def _from_template(template: str) -> str | None:
    if _teaches_xml(template):
        return "qwen_coder"
    if "<tool_call>" in template:
        return "qwen"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template:
        return "llama3"
    return None
