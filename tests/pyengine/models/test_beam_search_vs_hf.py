"""``LLM.beam_search`` against transformers' beam search on a tiny random Llama."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from tiny_models import BASE, make_hf_model, save_hf_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedModel

from candle_vllm import LLM, BeamSearchParams

WIDTH = 3
STEPS = 6


DEVICES = [pytest.param(True, id="cpu"), pytest.param(False, id="cuda", marks=pytest.mark.cuda)]


@pytest.fixture(scope="module", params=DEVICES)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[LLM, PreTrainedModel]:
    path = tmp_path_factory.mktemp("beam_llama")
    model = make_hf_model("llama", seed=7)
    with torch.no_grad():  # flatter next-token distributions, so the beams part early and overtake each other
        model.lm_head.weight.mul_(0.3)
    save_hf_model(model, path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(BASE["vocab_size"])}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))
    return LLM(model=str(path), dtype="f32", mem=16, cpu=request.param), model


@torch.inference_mode()
def hf_beams(model: PreTrainedModel, prompt: list[int]) -> tuple[list[list[int]], list[float]]:
    """transformers' beam search with no end token and no length penalty: the beams and their summed logprobs."""
    model.generation_config.eos_token_id = None
    generate: Any = model.generate  # transformers' GenerationMixin method (mypy sees nn.Module's __getattr__)
    out = generate(torch.tensor([prompt]), num_beams=WIDTH, num_return_sequences=WIDTH, do_sample=False,
                   max_new_tokens=STEPS, min_new_tokens=STEPS, length_penalty=0.0, early_stopping=False,
                   pad_token_id=0, return_dict_in_generate=True, output_scores=True)
    return [seq[len(prompt):].tolist() for seq in out.sequences], out.sequences_scores.tolist()


def test_beams_equal_transformers_beam_search(tiny: tuple[LLM, PreTrainedModel]) -> None:
    """Without an end token every step keeps the WIDTH best (beam, token) pairs by summed logprob, in both; so the
    beams, their order and their scores must agree. Prompts of several lengths run as one batch."""
    llm, model = tiny
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, BASE["vocab_size"], (n,), generator=g).tolist() for n in (1, 7, 20)]
    outs = llm.beam_search([{"prompt_token_ids": p} for p in prompts],
                           BeamSearchParams(beam_width=WIDTH, max_tokens=STEPS, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        want_tokens, want_scores = hf_beams(model, prompt)
        assert [seq.tokens[: len(prompt)] for seq in out.sequences] == [prompt] * WIDTH
        assert [seq.tokens[len(prompt):] for seq in out.sequences] == want_tokens
        assert [seq.cum_logprob for seq in out.sequences] == pytest.approx(want_scores, abs=1e-3)
        for seq in out.sequences:  # one logprobs entry per generated token, holding that token
            assert len(seq.logprobs) == STEPS and all(t in e for t, e in zip(seq.tokens[len(prompt):], seq.logprobs,
                                                                              strict=True))
            assert seq.cum_logprob == pytest.approx(sum(e[t].logprob for t, e in
                                                        zip(seq.tokens[len(prompt):], seq.logprobs, strict=True)))
            assert seq.finish_reason == "length"
            assert seq.text == llm.get_tokenizer().decode(seq.tokens, skip_special_tokens=False)
