"""Stop strings against a brute-force oracle: generation stops at the first chunk after which the text contains
a stop string, and the output is cut at the earliest occurrence; nothing emitted is ever retracted."""

from __future__ import annotations

import random

import pytest

from candle_vllm.pyengine.stop_strings import StopStringMatcher


def oracle(full: str, cuts: list[int], stops: list[str], include: bool, floor: int = 0) -> str:
    """``floor``: stop strings start there or later (the text of the first min_tokens tokens is not searched)."""
    for end in cuts:
        prefix = full[:end]
        found = [(prefix.find(s, floor), s) for s in stops if prefix.find(s, floor) >= 0]
        if found:
            pos = min(p for p, _ in found)
            stop = min((s for p, s in found if p == pos), key=len) if include else ""
            return prefix[: pos + len(stop)]
    return full


@pytest.mark.parametrize("unsearched", [0, 2])
@pytest.mark.parametrize("include", [False, True])
def test_random_pieces_match_oracle(include: bool, unsearched: int) -> None:
    """``unsearched``: the first pieces come in as a request's first min_tokens tokens do (never matched)."""
    rng = random.Random(7)
    alphabet = "ab c\n"
    for _ in range(2000):
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        cuts: list[int] = []
        while not cuts or cuts[-1] < len(full):
            cuts.append(min(len(full), (cuts[-1] if cuts else 0) + rng.randint(1, 4)))
        m = StopStringMatcher(stops, include)
        emitted = ""
        start = 0
        matched = False
        for i, end in enumerate(cuts):
            match = m.append(full[start:end], searchable=i >= unsearched)
            start = end
            if match:
                matched = True
                assert m.text.startswith(emitted)
                emitted = m.text
                break
            safe = m.safe_length()
            assert m.text[:safe].startswith(emitted)
            emitted = m.text[:safe]
        if not matched:
            emitted = m.text
        floor = cuts[min(unsearched, len(cuts)) - 1] if unsearched else 0
        want = oracle(full, cuts[unsearched:] or cuts[-1:], stops, include, floor)
        assert emitted == want, (full, stops, emitted, want)


def test_holds_back_partial_stop() -> None:
    m = StopStringMatcher(["</end>"])
    assert m.append("hello </e") is None
    assert m.text[: m.safe_length()] == "hello "
    match = m.append("nd> more")
    assert match is not None and match.stop == "</end>" and m.text == "hello "
