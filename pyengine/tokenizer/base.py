"""The engine's tokenizer: one ``tokenizers.Tokenizer`` plus the facts generation needs around it.

Whether the vocabulary came from a Hugging Face directory or from GGUF metadata, the rest of the engine
sees the same object: ids for prompts, text for outputs, the ids that end generation, and the chat
template that turns messages into a prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal, overload

import tokenizers

from candle_vllm.pyengine.tokenizer.chat_template import render_chat_template, select_chat_template

_CLEANUPS = (
    (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
    (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
)

_LONG_TEXT = 1 << 16  # characters; about 50 ms of tokenizing, below which holding the GIL does not matter


class Tokenizer:
    """Text <-> token ids for one model, with its special tokens and chat templates.

    ``special_tokens`` maps transformers' names (``bos_token``, ``eos_token``, ``unk_token``,
    ``pad_token``, ...) to token strings; chat templates see them as variables, as in transformers.
    ``chat_templates`` maps a name to a template; ``default`` is the one used unless another is asked
    for (``tool_use`` is preferred when tools are given, as transformers does).
    """

    def __init__(
        self,
        hf: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        pad_token_id: int | None = None,
        extra_stop_token_ids: Iterable[int] = (),
        special_tokens: dict[str, str] | None = None,
        chat_templates: dict[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.hf = hf
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.pad_token_id = pad_token_id
        self.stop_token_ids: set[int] = {i for i in (eos_token_id, *extra_stop_token_ids) if i is not None}
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.chat_template: str | None = self.chat_templates.get("default")
        self._clean_up_spaces = clean_up_tokenization_spaces
        with_specials = hf.encode("", add_special_tokens=True).ids
        self.add_bos: bool = bos_token_id is not None and with_specials[:1] == [bos_token_id]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; special-token strings in it are matched whole (chat prompts need that).

        ``add_special_tokens`` adds what the model's tokenizer adds around a sequence (BOS for most).
        A long text goes through ``encode_batch``, the one call of ``tokenizers`` that releases the GIL: a
        prompt of megabytes takes seconds, and other threads (the server's event loop) must keep running.
        """
        if len(text) >= _LONG_TEXT:
            return self.hf.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int] | int, skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (or of one id, as transformers takes it); special (control) tokens are dropped unless
        ``skip_special_tokens`` is False."""
        text = self.hf.decode([ids] if isinstance(ids, int) else list(ids), skip_special_tokens=skip_special_tokens)
        if self._clean_up_spaces:
            for before, after in _CLEANUPS:
                text = text.replace(before, after)
        return text

    # transformers' tokenizer surface that code written for vLLM calls on ``llm.get_tokenizer()``.

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    def get_vocab(self) -> dict[str, int]:
        """Token string -> id, added tokens included."""
        return self.hf.get_vocab(with_added_tokens=True)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """The vocabulary strings of ``ids`` (None for an id outside the vocabulary)."""
        return [self.hf.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: Sequence[str]) -> list[int | None]:
        return [self.hf.token_to_id(t) for t in tokens]

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def id_to_piece(self, token_id: int) -> str:
        """The text one token stands for, shown in logprob listings (bytes of a partial character
        come out as U+FFFD, as in vLLM)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def token_to_id(self, token: str) -> int | None:
        """Id of a token given by its vocabulary string (e.g. ``"<|im_end|>"``), or None."""
        return self.hf.token_to_id(token)

    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        tokenize: Literal[False] = False,
    ) -> str: ...

    @overload
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        tokenize: Literal[True],
    ) -> list[int]: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        documents: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        tokenize: bool = False,
    ) -> str | list[int]:
        """Render ``messages`` to prompt text exactly as transformers' ``apply_chat_template`` would.

        ``chat_template`` may be a template name (from ``chat_templates``) or a whole template.
        ``continue_final_message`` and ``tokenize`` are transformers' keywords, because code written for vLLM calls
        ``llm.get_tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)``;
        ``tokenize=True`` gives the prompt's ids (special tokens come from the template, none are added), but
        unlike transformers the default is text.
        Raises ``ChatTemplateError`` (a ValueError) when the template rejects the conversation.
        """
        template = select_chat_template(self.chat_templates, chat_template, tools)
        text = render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            template_kwargs=chat_template_kwargs,
            continue_final_message=continue_final_message,
        )
        return self.encode(text, add_special_tokens=False) if tokenize else text
