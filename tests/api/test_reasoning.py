"""The reasoning splitter at every split point of hand-checked outputs, marker discovery from a real
``tokenizers`` vocabulary / chat template, and prompts that end inside an open marker."""

from __future__ import annotations

import random

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from candle_vllm.api.reasoning import (
    ReasoningSplitter,
    ThinkMarkers,
    prompt_opens_reasoning,
    think_markers,
)
from candle_vllm.pyengine.tokenizer import Tokenizer as EngineTokenizer

THINK = ThinkMarkers("<think>", "</think>")
KIMI = ThinkMarkers("\u25c1think\u25b7", "\u25c1/think\u25b7")

# (markers, starts in reasoning, output, expected reasoning, expected content), checked by hand.
CASES = [
    (THINK, False, "<think>plan it</think>\n\nThe answer.", "plan it", "\n\nThe answer."),
    (THINK, False, "no reasoning at all", "", "no reasoning at all"),
    (THINK, True, "opened by the prompt</think>reply", "opened by the prompt", "reply"),
    (THINK, True, "never closed <think", "never closed <think", ""),
    (THINK, False, "a <think>b</think> c <think>d</think>e", "bd", "a  c e"),
    (THINK, False, "x < y and </thin but <thinker>", "", "x < y and </thin but <thinker>"),
    (THINK, False, "<think></think>", "", ""),
    (THINK, False, "ends with a partial <thi", "", "ends with a partial <thi"),
    (THINK, True, "<<</think>>", "<<", ">"),
    (KIMI, False, "\u25c1think\u25b7\u601d\u8003\u25c1/think\u25b7\u7b54", "\u601d\u8003", "\u7b54"),
]


def run(markers: ThinkMarkers, start: bool, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(markers, start)
    reasoning, content = [], []
    for piece in pieces:
        r, c = splitter.push(piece)
        reasoning.append(r)
        content.append(c)
    r, c = splitter.finish()
    return "".join(reasoning) + r, "".join(content) + c


@pytest.mark.parametrize(("markers", "start", "text", "reasoning", "content"), CASES)
def test_every_split_point_gives_the_same_split(markers: ThinkMarkers, start: bool, text: str, reasoning: str,
                                                content: str) -> None:
    assert run(markers, start, [text]) == (reasoning, content)
    assert run(markers, start, list(text)) == (reasoning, content)  # one character at a time
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            assert run(markers, start, [text[:i], text[i:j], text[j:]]) == (reasoning, content), (i, j)


def test_random_fragmentation_and_no_early_release() -> None:
    rng = random.Random(7)
    words = ["<think>", "</think>", "<", "</", "think", ">", "a", " b", "\n", "<thi", "nk>", "</th", "ink>"]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(1, 25)))
        start = rng.random() < 0.5
        whole = run(THINK, start, [text])
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert run(THINK, start, pieces) == whole
    # Oracle for the whole text: regex-free split by str.partition, written independently of the splitter.
    text = "pre<think>mid</think>post"
    before, _, rest = text.partition("<think>")
    mid, _, after = rest.partition("</think>")
    assert run(THINK, False, [text]) == (mid, before + after)


def test_partial_marker_is_held_then_released() -> None:
    splitter = ReasoningSplitter(THINK, False)
    assert splitter.push("Hello <th") == ("", "Hello ")
    assert splitter.push("ink") == ("", "")
    assert splitter.push(">hm") == ("hm", "")
    assert splitter.push("</") == ("", "")
    assert splitter.push("b>") == ("</b>", "")  # not the end marker: released as reasoning
    assert splitter.push("</think") == ("", "")
    assert splitter.finish() == ("</think", "")  # output ended: the held text stays where it stood


def tokenizer_with(added: list[str], special: bool, template: str | None = None) -> EngineTokenizer:
    vocab = {ch: i for i, ch in enumerate(sorted(set("abcdefghijklmnopqrstuvwxyz<>/[]_ \n")))}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="_"))
    hf.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    hf.add_tokens([AddedToken(t, special=special, normalized=False) for t in added])
    return EngineTokenizer(hf, bos_token_id=None, eos_token_id=None,
                           chat_templates={"default": template} if template else None)


def test_markers_from_vocabulary_template_or_none() -> None:
    assert think_markers(tokenizer_with(["<think>", "</think>"], special=False)) == THINK
    assert think_markers(tokenizer_with(["[THINK]", "[/THINK]"], special=True)) == ThinkMarkers("[THINK]", "[/THINK]")
    # Only the start marker is a token: not a pair the model can write.
    assert think_markers(tokenizer_with(["<think>"], special=False)) is None
    by_template = tokenizer_with([], special=False, template="{{ m }}{% if x %}<thinking>\n\n</thinking>{% endif %}")
    assert think_markers(by_template) == ThinkMarkers("<thinking>", "</thinking>")
    assert think_markers(tokenizer_with([], special=False, template="{{ messages }}")) is None


def test_splitter_on_real_token_stream() -> None:
    tok = tokenizer_with(["<think>", "</think>"], special=True)
    text = "<think>a b</think>\nc<think>d"
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) == 9  # the markers are single tokens
    pieces = [tok.decode([i], skip_special_tokens=False) for i in ids]
    assert run(THINK, False, pieces) == ("a bd", "\nc")


@pytest.mark.parametrize(
    ("prompt", "opens"),
    [
        ("<|im_start|>assistant\n<think>\n", True),  # DeepSeek-R1 style generation prompt
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # Qwen3 with enable_thinking=False
        ("<|im_start|>assistant\n", False),
        ("<think>old</think>answer<|im_start|>user\nq<|im_start|>assistant\n<think>", True),
        ("<think>old</think>answer<|im_start|>assistant\n", False),
    ],
)
def test_prompt_opens_reasoning(prompt: str, opens: bool) -> None:
    assert prompt_opens_reasoning(prompt, THINK) is opens
