"""The offline API as code written for vLLM uses it (vLLM's docs and examples), on the real SmolLM2 GGUF (CPU):
what such code calls must exist and mean what it means in vLLM."""

from __future__ import annotations

import math

import pytest

import candle_vllm
from candle_vllm import LLM, PoolingParams, SamplingParams
from candle_vllm.pyengine.engine_args import UnsupportedFeatureError
from candle_vllm.pyengine.sampling import SamplingDefaults

PROMPTS = ["Once upon a time,", "List five random words:"]
CONVERSATION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(mem=64)


def test_cumulative_logprob_is_the_sum_of_the_chosen_tokens_logprobs(llm: LLM) -> None:
    """vLLM's CompletionOutput.cumulative_logprob (users rank n > 1 choices by it): the sum of the sampled tokens'
    logprobs when ``logprobs`` is asked for, None otherwise (vLLM v1's LogprobsProcessor)."""
    out = llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=6, logprobs=0))[0]
    for choice in out.outputs:
        assert choice.logprobs is not None and choice.cumulative_logprob is not None
        want = math.fsum(entry[t].logprob for t, entry in zip(choice.token_ids, choice.logprobs, strict=True))
        assert choice.cumulative_logprob == pytest.approx(want, abs=1e-9) and choice.cumulative_logprob < 0
    assert llm.generate(PROMPTS[0], SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None


def test_unseeded_sampling_repeats_from_run_to_run() -> None:
    """vLLM V1's engine seed defaults to 0 (vLLM PR 17929, docs' "Reproducibility"): a script sampling without
    per-request seeds gets the same tokens each time it runs; ``seed=None`` keeps a fresh stream per engine."""
    params = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    first, second = ([o.outputs[0].token_ids for o in LLM(mem=64).generate(PROMPTS, params)] for _ in range(2))
    assert first == second


def test_vllm_engine_arg_names_are_accepted() -> None:
    """``LLM(model, dtype="float32", enforce_eager=True, ...)`` as vLLM's examples write it: the names that mean
    what one of ours means are translated; tensor parallelism is refused as not built, not as an unknown name."""
    llm = LLM(mem=64, dtype="float32", enforce_eager=True, enable_prefix_caching=False, tensor_parallel_size=1,
              trust_remote_code=True)
    args = llm.engine.args
    assert (args.dtype, args.disable_cuda_graph, args.disable_prefix_cache, args.device_ids) == ("f32", True, True,
                                                                                                  None)
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0]
    assert len(out.token_ids) == 4
    with pytest.raises(UnsupportedFeatureError, match="tensor parallelism"):
        LLM(mem=64, tensor_parallel_size=2)
    with pytest.raises(TypeError, match="not both"):
        LLM(mem=64, enforce_eager=True, disable_cuda_graph=False)


def test_text_and_tokens_prompt_types(llm: LLM) -> None:
    """``from vllm import TextPrompt, TokensPrompt`` ports as ``from candle_vllm import ...``."""
    params = SamplingParams(temperature=0, max_tokens=5)
    ids = llm.get_tokenizer().encode(PROMPTS[1])
    prompts = [candle_vllm.TextPrompt(prompt=PROMPTS[1]), candle_vllm.TokensPrompt(prompt_token_ids=ids)]
    by_text, by_ids = llm.generate(prompts, params)
    assert by_text.prompt_token_ids == by_ids.prompt_token_ids == ids
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids


def test_chat_continue_final_message(llm: LLM) -> None:
    """vLLM's ``chat(..., add_generation_prompt=False, continue_final_message=True)``: the prompt ends inside the
    assistant message the caller began (no end-of-turn after it), and the reply continues it."""
    begun = [*CONVERSATION, {"role": "assistant", "content": "The answer is"}]
    params = SamplingParams(temperature=0, max_tokens=6)
    out = llm.chat(begun, params, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt is not None and out.prompt.endswith("<|im_start|>assistant\nThe answer is")
    assert out.prompt_token_ids == llm.get_tokenizer().encode(out.prompt, add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        llm.chat(begun, params, continue_final_message=True)


def test_tokenizer_apply_chat_template_tokenize_keyword(llm: LLM) -> None:
    """vLLM's examples render prompts with ``llm.get_tokenizer().apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``; that prompt (or ``tokenize=True``'s ids) must be what ``chat`` sends."""
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(CONVERSATION, tokenize=False, add_generation_prompt=True)
    ids = tok.apply_chat_template(CONVERSATION, tokenize=True, add_generation_prompt=True)
    chat = llm.chat(CONVERSATION, SamplingParams(temperature=0, max_tokens=1))[0]
    assert (text, ids) == (chat.prompt, chat.prompt_token_ids)


def test_get_default_sampling_params(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's ``llm.get_default_sampling_params()``: the model's generation_config.json sampling values over
    SamplingParams' defaults; callers change a field or two and pass it back."""
    model_defaults = SamplingDefaults.from_generation_config({"temperature": 0.6, "top_k": 20})
    monkeypatch.setattr(llm.engine, "sampling_defaults", model_defaults)
    params = llm.get_default_sampling_params()
    assert (params.temperature, params.top_k, params.top_p) == (0.6, 20, 1.0)
    params.max_tokens = 3
    assert len(llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids) <= 3


def test_generation_config_fills_only_calls_without_params(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM applies a model's generation_config.json only when ``generate`` gets no SamplingParams
    (``get_default_sampling_params``); a caller's own params keep vLLM's defaults where they say nothing, so a
    greedy evaluation gets no repetition penalty the model's config asks for (Qwen2.5's 1.05)."""
    monkeypatch.setattr(llm.engine, "sampling_defaults", SamplingDefaults(repetition_penalty=1.5))
    greedy = {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True}
    own = llm.generate(PROMPTS[1], SamplingParams(**greedy))[0].outputs[0].token_ids
    plain = llm.generate(PROMPTS[1], SamplingParams(**greedy, repetition_penalty=1.0))[0].outputs[0].token_ids
    penalised = llm.generate(PROMPTS[1], SamplingParams(**greedy, repetition_penalty=1.5))[0].outputs[0].token_ids
    assert own == plain and penalised != plain
    assert llm.get_default_sampling_params().repetition_penalty == 1.5


def test_the_tokenizer_answers_as_transformers_does(llm: LLM) -> None:
    """What code written for vLLM calls on ``llm.get_tokenizer()`` (a transformers tokenizer there), against
    transformers' own fast tokenizer over the same vocabulary and special tokens."""
    transformers = pytest.importorskip("transformers")
    tok = llm.get_tokenizer()
    ref = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.hf, eos_token=tok.eos_token,
                                               bos_token=tok.bos_token)
    ids = tok.encode("Hello <|im_end|> wörld", add_special_tokens=False)
    assert len(tok) == len(ref) and tok.get_vocab() == ref.get_vocab()
    assert (tok.eos_token, tok.eos_token_id) == (ref.eos_token, ref.eos_token_id)
    assert tok.convert_ids_to_tokens(ids) == ref.convert_ids_to_tokens(ids)
    assert tok.convert_tokens_to_ids(ref.convert_ids_to_tokens(ids)) == ids
    assert tok.batch_decode([ids, ids[:2]]) == ref.batch_decode([ids, ids[:2]], skip_special_tokens=True)
    assert tok.decode(ids[0]) == ref.decode(ids[0])


def test_truncate_prompt_tokens_runs_the_prompts_last_tokens(llm: LLM) -> None:
    """vLLM's ``truncate_prompt_tokens``: a prompt longer than wanted runs as its last k tokens (greedy output
    equal to sending those k tokens), -1 means the model's context length, and more than that is refused."""
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog and runs far away.")
    greedy = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    cut = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=5, **greedy))[0]
    direct = llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(**greedy))[0]
    assert cut.prompt_token_ids == ids[-5:] and cut.outputs[0].token_ids == direct.outputs[0].token_ids
    whole = llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=-1, **greedy))[0]
    assert whole.prompt_token_ids == ids
    with pytest.raises(ValueError, match="greater than max_model_len"):
        llm.generate({"prompt_token_ids": ids}, SamplingParams(truncate_prompt_tokens=llm.engine.max_model_len + 1))
    for bad in (0, -2):
        with pytest.raises(ValueError, match="truncate_prompt_tokens must be -1"):
            SamplingParams(truncate_prompt_tokens=bad)
    vectors = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": ids[-5:]}, {"prompt_token_ids": ids}],
                                                      [PoolingParams(), PoolingParams(truncate_prompt_tokens=5)])]
    assert vectors[1] == pytest.approx(vectors[0], abs=1e-6)
    by_keyword = llm.embed({"prompt_token_ids": ids}, truncate_prompt_tokens=5)[0].outputs.embedding
    assert by_keyword == pytest.approx(vectors[0], abs=1e-6)
    # A prompt longer than the context, cut first: its default max_tokens is the one of what is left (the async
    # intake prepares requests the same way).
    longer = ids * (llm.engine.max_model_len // len(ids) + 1)
    kept, resolved = llm.engine.prepare(longer, SamplingParams(truncate_prompt_tokens=10))
    assert kept == longer[-10:] and resolved.max_tokens == llm.engine.prepare(kept, SamplingParams())[1].max_tokens


def test_allowed_token_ids_hold_every_generated_token(llm: LLM) -> None:
    """vLLM's allowed_token_ids: sampled or greedy, every token comes from the list (a yes/no classifier's use)."""
    tok = llm.get_tokenizer()
    choices = sorted({tok.encode(" yes", add_special_tokens=False)[0], tok.encode(" no", add_special_tokens=False)[0]})
    for params in (SamplingParams(temperature=0, max_tokens=5, allowed_token_ids=choices, ignore_eos=True),
                   SamplingParams(temperature=1.0, seed=4, max_tokens=8, allowed_token_ids=choices, ignore_eos=True)):
        tokens = llm.generate(PROMPTS[1], params)[0].outputs[0].token_ids
        assert len(tokens) == params.max_tokens and set(tokens) <= set(choices)


def test_bad_words_keep_a_word_out_of_the_output(llm: LLM) -> None:
    """vLLM's bad_words end to end on the real model: the word greedy decoding writes first is banned, in both its
    bare and its spaced tokenization (vLLM's rule), and the new output holds neither sequence."""
    tok = llm.get_tokenizer()
    greedy = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    first = llm.generate(PROMPTS[0], SamplingParams(**greedy))[0].outputs[0]
    word = first.text.split()[0]
    out = llm.generate(PROMPTS[0], SamplingParams(bad_words=[word], **greedy))[0].outputs[0]
    forms = [tok.encode(word, add_special_tokens=False), tok.encode(" " + word, add_special_tokens=False)]
    assert out.token_ids != first.token_ids
    for ids in forms:
        assert not any(list(out.token_ids[i:i + len(ids)]) == ids for i in range(len(out.token_ids))), (word, ids)


def test_priority_scheduling_serves_lower_priorities_first() -> None:
    """vLLM's ``scheduling_policy="priority"`` with ``generate(..., priority=[...])``: with one sequence at a
    time, the requests start in priority order (lower first), not in the order given; under the default fcfs
    policy a priority is refused, naming the setting."""
    prompts = ["One", "Two", "Three"]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = LLM(mem=64, max_num_seqs=1, scheduling_policy="priority").generate(prompts, params, priority=[2, 0, 1])
    started = [o.metrics.first_scheduled_time or 0.0 for o in outs]
    assert all(started) and sorted(range(3), key=lambda i: started[i]) == [1, 2, 0]
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        LLM(mem=64).generate(prompts[:1], params, priority=[1])
