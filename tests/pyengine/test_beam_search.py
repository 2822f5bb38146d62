"""Beam search's stop-token and scoring rules on hand-made candidates (``models/test_beam_search_vs_hf.py`` runs
``LLM.beam_search`` against transformers')."""

from __future__ import annotations

import math

import pytest

from candle_vllm import BeamSearchParams
from candle_vllm.pyengine.beam_search import BeamSearch, beam_score
from candle_vllm.pyengine.outputs import Logprob


def entry(**logprobs: float) -> dict[int, Logprob]:
    return {int(k.removeprefix("t")): Logprob(v) for k, v in logprobs.items()}


def test_stop_tokens_complete_beams_that_compete_at_the_end() -> None:
    """Token 9 stops. Step 1 offers 9 (-0.1) and 5 (-1.0): 9 completes a beam, 5 goes on; step 2 offers 6 (-3.0).
    Scores (vLLM's rule, prompt of 2 included, a final stop token not counted, length_penalty 1):
    [1, 2, 9] -> -0.1 / 2; [1, 2, 5, 6] -> -4.0 / 4. The stopped beam wins; a response shows its text without
    the stop token."""
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=2), stop_token_ids={9})
    assert search.beam_prompts() == [[1, 2]] and search.step_params.logprobs == 4
    search.advance([entry(t9=-0.1, t5=-1.0)])
    assert search.beam_prompts() == [[1, 2, 5]] and not search.done
    search.advance([entry(t6=-3.0)])
    assert search.done
    out = search.best()
    assert [(s.tokens, s.finish_reason, s.stop_reason) for s in out.sequences] == [
        ([1, 2, 9], "stop", 9), ([1, 2, 5, 6], "length", None)]
    assert [s.cum_logprob for s in out.sequences] == pytest.approx([-0.1, -4.0])
    assert [search.shown_tokens(s) for s in out.sequences] == [[], [5, 6]]
    assert beam_score([1, 2, 9], -0.1, {9}, 1.0) == pytest.approx(-0.05)
    assert beam_score([1, 2, 5, 6], -4.0, {9}, 2.0) == pytest.approx(-4.0 / 16)


def test_length_penalty_can_turn_the_ranking() -> None:
    """Two stopped beams: [1, 9] at -0.5 (length 1) and [1, 5, 9] at -0.8 (length 2). With length_penalty 0 the
    higher sum wins; with 2, -0.8 / 4 beats -0.5 / 1."""
    for penalty, first in ((0.0, [1, 9]), (2.0, [1, 5, 9])):
        search = BeamSearch([1], BeamSearchParams(beam_width=2, max_tokens=2, length_penalty=penalty), {9})
        search.advance([entry(t9=-0.5, t5=-0.3)])
        search.advance([entry(t9=-0.5)])
        assert search.best().sequences[0].tokens == first


def test_ignore_eos_and_stop_text_options() -> None:
    kept = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=1, include_stop_str_in_output=True), {9})
    kept.advance([entry(t9=-0.5)])
    assert kept.shown_tokens(kept.best().sequences[0]) == [9]
    ignored = BeamSearch([1], BeamSearchParams(beam_width=1, max_tokens=2, ignore_eos=True), {9})
    ignored.advance([entry(t9=-0.5)])
    assert ignored.beam_prompts() == [[1, 9]] and not ignored.done


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"beam_width": 0}, "beam_width"), ({"beam_width": 11}, "beam_width"), ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": -1.0}, "temperature"), ({"length_penalty": math.inf}, "length_penalty"),
])
def test_params_are_checked(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})  # type: ignore[arg-type]
