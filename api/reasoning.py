"""Reasoning split (contract R): text a model writes between think markers goes to ``reasoning_content``.

Reasoning models wrap their chain of thought in markers (``<think>``...``</think>`` for Qwen3 and DeepSeek-R1,
other spellings for other families). Clients want it apart from the answer, in the whole message and in every
stream delta, so the split must work on arbitrary fragments: a marker may arrive over several deltas, and a
prompt whose template already opened the marker makes the output start inside the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ThinkMarkers:
    """The strings that open and close a reasoning block."""

    start: str
    end: str


# The spellings model families use, most common first: Qwen3 / DeepSeek-R1 / QwQ, generic, ByteDance Seed-OSS,
# Kimi, Mistral Magistral.
KNOWN_MARKERS: tuple[ThinkMarkers, ...] = (
    ThinkMarkers("<think>", "</think>"),
    ThinkMarkers("<thinking>", "</thinking>"),
    ThinkMarkers("<seed:think>", "</seed:think>"),
    ThinkMarkers("\u25c1think\u25b7", "\u25c1/think\u25b7"),
    ThinkMarkers("[THINK]", "[/THINK]"),
)


def think_markers(tokenizer: Any) -> ThinkMarkers | None:
    """The model's think markers: a known pair that its vocabulary holds as single tokens, else one its chat
    templates write; ``None`` for models without a reasoning mode (their output is never split)."""
    for markers in KNOWN_MARKERS:
        if tokenizer.token_to_id(markers.start) is not None and tokenizer.token_to_id(markers.end) is not None:
            return markers
    templates = "\n".join(getattr(tokenizer, "chat_templates", {}).values())
    for markers in KNOWN_MARKERS:
        if markers.end in templates:
            return markers
    return None


def prompt_opens_reasoning(prompt_text: str, markers: ThinkMarkers) -> bool:
    """Whether the prompt ends inside an open reasoning block (templates such as DeepSeek-R1's end the
    generation prompt with ``<think>``), so the model's first words are reasoning."""
    start = prompt_text.rfind(markers.start)
    return start >= 0 and prompt_text.rfind(markers.end) < start


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest proper prefix of ``marker`` that ``text`` ends with (text to hold back)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0


class ReasoningSplitter:
    """Splits one choice's output text into reasoning and content as it streams.

    Text that could be the beginning of the marker it is waiting for is held back until the next push shows
    whether it is one; markers themselves appear in neither part. Blocks may open and close several times.
    """

    def __init__(self, markers: ThinkMarkers, in_reasoning: bool) -> None:
        self.markers = markers
        self.in_reasoning = in_reasoning
        self._held = ""

    def push(self, text: str) -> tuple[str, str]:
        """Feed the next piece of output; returns the ``(reasoning, content)`` text safe to release now."""
        text = self._held + text
        self._held = ""
        reasoning: list[str] = []
        content: list[str] = []
        while text:
            marker = self.markers.end if self.in_reasoning else self.markers.start
            out = reasoning if self.in_reasoning else content
            at = text.find(marker)
            if at >= 0:
                out.append(text[:at])
                text = text[at + len(marker):]
                self.in_reasoning = not self.in_reasoning
                continue
            keep = _partial_suffix(text, marker)
            out.append(text[: len(text) - keep])
            self._held = text[len(text) - keep:]
            break
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """End of output: held text was no marker after all and goes where it stood."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)
