"""End to end: vLLM's request extras ``prompt_logprobs``, ``return_tokens_as_token_ids`` and ``use_beam_search``
through the real server, engine and ``openai`` client, with llama.cpp on the same F32 GGUF file as the oracle for
every prompt position's logprob, rank and top-k, and for the beams (F32 weights and caches on both sides agree to
~2e-5 per token; see test_e2e_lm_eval.py)."""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any

import numpy as np
import openai
import pytest

from tests.api.conftest import ServerThread

TOL = 1e-3
PROMPT = "The capital of France is Paris, and the capital of Germany is"
MESSAGES = [{"role": "user", "content": "Name a colour of the sky."}]


def oracle_rows(llm: Any, ids: list[int]) -> np.ndarray:
    """llama.cpp's log-softmax rows: row i is the distribution of the token after ids[: i + 1]."""
    llm.reset()
    llm.eval(ids)
    logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)
    logits -= logits.max(axis=-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))


def check_against_oracle(entries: list[Any], ids: list[int], rows: np.ndarray, k: int) -> None:
    """Each position's entry (vLLM's wire shape) against llama.cpp: the prompt token's logprob and rank, and the k
    most likely tokens with their ranks; None only at position 0."""
    assert len(entries) == len(ids) and entries[0] is None
    for i in range(1, len(ids)):
        entry, row = entries[i], rows[i - 1]
        assert isinstance(entry, dict) and all(re.fullmatch(r"\d+", key) for key in entry), entry
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(row[ids[i]], abs=TOL)
        # rank: 1 + how many tokens are strictly more likely, up to near-ties
        assert (row > row[ids[i]] + TOL).sum() + 1 <= own["rank"] <= (row > row[ids[i]] - TOL).sum() + 1
        ranked = {v["rank"]: (int(t), v["logprob"]) for t, v in entry.items() if t != str(ids[i])}
        assert set(ranked) | ({own["rank"]} if own["rank"] <= k else set()) == set(range(1, k + 1)), entry
        assert len(entry) in (k, k + 1)
        best = np.sort(row)[::-1]
        for rank, (token, logprob) in ranked.items():
            assert logprob == pytest.approx(row[token], abs=TOL) and logprob == pytest.approx(best[rank - 1], abs=TOL)
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def tokenize(server: ServerThread, body: dict[str, Any]) -> list[int]:
    with server.http() as http:
        reply = http.post("/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    return list(reply.json()["tokens"])


def test_completion_prompt_logprobs_match_llama_cpp(f32_server: ServerThread, f32_model: str, f32_oracle: Any) -> None:
    ids = tokenize(f32_server, {"prompt": PROMPT})
    with f32_server.http() as http:
        reply = http.post("/v1/completions", json={"model": f32_model, "prompt": PROMPT, "max_tokens": 2,
                                                   "temperature": 0, "prompt_logprobs": 5})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["text"] and choice["logprobs"] is None
    check_against_oracle(choice["prompt_logprobs"], ids, oracle_rows(f32_oracle, ids), 5)
    # vLLM's shape without the field: the key is there, null
    plain = f32_server.openai().completions.create(model=f32_model, prompt=PROMPT, max_tokens=1, temperature=0)
    assert plain.choices[0].model_extra["prompt_logprobs"] is None


def test_chat_prompt_logprobs_are_top_level(f32_server: ServerThread, f32_model: str, f32_oracle: Any) -> None:
    ids = tokenize(f32_server, {"messages": MESSAGES})
    reply = f32_server.openai().chat.completions.create(model=f32_model, messages=MESSAGES, max_tokens=2, temperature=0,
                                                    extra_body={"prompt_logprobs": 2})
    entries = reply.model_extra["prompt_logprobs"]
    assert reply.usage.prompt_tokens == len(ids)
    check_against_oracle(entries, ids, oracle_rows(f32_oracle, ids), 2)
    zero = f32_server.openai().chat.completions.create(model=f32_model, messages=MESSAGES, max_tokens=1, temperature=0,
                                                   extra_body={"prompt_logprobs": 0}).model_extra["prompt_logprobs"]
    assert all(list(e) == [str(t)] for e, t in zip(zero[1:], ids[1:], strict=True))  # k = 0: the token alone


def test_echo_and_prompt_logprobs_each_take_their_k(f32_server: ServerThread, f32_model: str) -> None:
    """One engine run serves both views: echo's top_logprobs keep ``logprobs`` (1), prompt_logprobs keep 4."""
    reply = f32_server.openai().completions.create(model=f32_model, prompt=PROMPT, max_tokens=1, temperature=0, echo=True,
                                               logprobs=1, extra_body={"prompt_logprobs": 4})
    choice = reply.choices[0]
    entries = choice.model_extra["prompt_logprobs"]
    n = len(entries)
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == n + 1
    for i in range(1, n):
        assert len(entries[i]) in (4, 5) and len(choice.logprobs.top_logprobs[i]) in (1, 2)
        by_text = {v["decoded_token"]: v["logprob"] for v in entries[i].values()}
        for text, logprob in choice.logprobs.top_logprobs[i].items():
            assert logprob == pytest.approx(by_text[text], abs=1e-6)


@pytest.mark.parametrize(("extra", "message"), [
    ({"prompt_logprobs": 1, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": 0, "stream": True}, "not available when `stream=True`"),
    ({"prompt_logprobs": -1}, "greater than max allowed: 20"),
    ({"prompt_logprobs": 21}, "greater than max allowed: 20"),
    ({"prompt_logprobs": -2}, "greater than or equal to -1"),
])
def test_prompt_logprobs_refusals(f32_server: ServerThread, f32_model: str, extra: dict[str, Any], message: str) -> None:
    client = f32_server.openai()
    for call in (lambda: client.completions.create(model=f32_model, prompt=PROMPT, max_tokens=1, extra_body=extra),
                 lambda: client.chat.completions.create(model=f32_model, messages=MESSAGES, max_tokens=1,
                                                        extra_body=extra)):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)) as info:
            call()
        assert info.value.body["param"] == "prompt_logprobs"


def test_return_tokens_as_token_ids(f32_server: ServerThread, f32_model: str) -> None:
    """Token texts become ``token_id:N`` (prompt, generated and candidates); the values, the text and the chat
    ``bytes`` stay those of the plain request."""
    client = f32_server.openai()
    ids = tokenize(f32_server, {"prompt": PROMPT})
    kw: dict[str, Any] = {"model": f32_model, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "echo": True,
                          "logprobs": 2}
    plain = client.completions.create(**kw).choices[0]
    named = client.completions.create(**kw, extra_body={"return_tokens_as_token_ids": True}).choices[0]
    tokens = named.logprobs.tokens
    assert all(re.fullmatch(r"token_id:\d+", t) for t in tokens)
    got_ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert got_ids[: len(ids)] == ids and named.text == plain.text
    assert f32_server.engine.tokenizer.decode(got_ids[len(ids):]) == plain.text[len(PROMPT):]
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    assert [b - a for a, b in pairwise(named.logprobs.text_offset)] == [len(t) for t in tokens[:-1]]
    for top in named.logprobs.top_logprobs[1:]:
        assert all(re.fullmatch(r"token_id:\d+", t) for t in top)

    chat = client.chat.completions.create(model=f32_model, messages=MESSAGES, max_tokens=5, temperature=0,
                                          logprobs=True, top_logprobs=2,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0]
    items = chat.logprobs.content
    assert all(re.fullmatch(r"token_id:\d+", t.token) for t in items)
    assert all(re.fullmatch(r"token_id:\d+", c.token) for t in items for c in t.top_logprobs)
    assert bytes(b for t in items for b in t.bytes).decode() == chat.message.content


def oracle_beams(llm: Any, prompt: list[int], width: int, steps: int, stop_ids: frozenset[int] = frozenset(),
                 length_penalty: float = 1.0) -> list[tuple[list[int], bool]]:
    """vLLM's beam search rule over llama.cpp's logprobs: each beam offers its 2 * width most likely tokens, a stop
    token completes a beam, the rest keep the width best; at the end completed and live beams compete by summed
    logprob over (prompt + generated, a final stop token not counted) ** length_penalty. The width best
    continuations, best first, each with whether it stopped."""
    def score(c: tuple[float, list[int]]) -> float:
        stopped = bool(c[1]) and c[1][-1] in stop_ids
        return c[0] / (len(prompt) + len(c[1]) - stopped) ** length_penalty

    beams: list[tuple[float, list[int]]] = [(0.0, [])]
    completed: list[tuple[float, list[int]]] = []
    for _ in range(steps):
        candidates = []
        for total, tokens in beams:
            row = oracle_rows(llm, prompt + tokens)[-1]
            for t in np.argsort(row)[::-1][: 2 * width]:
                (completed if int(t) in stop_ids else candidates).append((total + float(row[t]), [*tokens, int(t)]))
        beams = sorted(candidates, key=score, reverse=True)[:width]
    best = sorted(completed + beams, key=score, reverse=True)[:width]
    return [(tokens, bool(tokens) and tokens[-1] in stop_ids) for _, tokens in best]


def test_beam_search_matches_llama_cpp(f32_server: ServerThread, f32_model: str, f32_oracle: Any) -> None:
    """``use_beam_search`` with ``n`` beams: the choices are llama.cpp's best beams, best first, in completions and
    in chat; usage counts every beam's tokens."""
    client = f32_server.openai()
    decode = f32_server.engine.tokenizer.decode
    ids = tokenize(f32_server, {"prompt": PROMPT})
    beam = {"use_beam_search": True, "ignore_eos": True}
    reply = client.completions.create(model=f32_model, prompt=PROMPT, n=3, max_tokens=4, extra_body=beam)
    want = oracle_beams(f32_oracle, ids, 3, 4)
    assert [c.text for c in reply.choices] == [decode(t) for t, _ in want]
    assert [c.index for c in reply.choices] == [0, 1, 2] and {c.finish_reason for c in reply.choices} == {"length"}
    assert reply.usage.completion_tokens == 12 and reply.usage.prompt_tokens == len(ids)

    chat_ids = tokenize(f32_server, {"messages": MESSAGES})
    chat = client.chat.completions.create(model=f32_model, messages=MESSAGES, n=2, max_tokens=3, extra_body=beam)
    assert [c.message.content for c in chat.choices] == [decode(t) for t, _ in oracle_beams(f32_oracle, chat_ids, 2, 3)]


def test_beam_search_stops_as_vllm_ranks_it(f32_server: ServerThread, f32_model: str, f32_oracle: Any) -> None:
    """With the end token live, beams that end compete with the running ones by vLLM's length-normalised score:
    the choices, their finish reasons and texts (the stop token left out) follow the llama.cpp-scored rule."""
    client = f32_server.openai()
    tokenizer = f32_server.engine.tokenizer
    messages = [{"role": "user", "content": "Reply with one word: what colour is the sky?"}]
    ids = tokenize(f32_server, {"messages": messages})
    stops = frozenset(tokenizer.stop_token_ids)
    for penalty in (1.0, 0.0):
        want = oracle_beams(f32_oracle, ids, 2, 8, stops, penalty)
        reply = client.chat.completions.create(model=f32_model, messages=messages, n=2, max_tokens=8, temperature=0,
                                               extra_body={"use_beam_search": True, "length_penalty": penalty})
        assert [c.message.content for c in reply.choices] == \
            [tokenizer.decode(t[:-1] if stopped else t) for t, stopped in want]
        assert [c.finish_reason for c in reply.choices] == ["stop" if stopped else "length" for _, stopped in want]
        assert reply.usage.completion_tokens == sum(len(t) for t, _ in want)
    assert any(stopped for _, stopped in want), "the prompt must let a beam end"


@pytest.mark.parametrize(("extra", "param"), [
    ({"stream": True}, "stream"), ({"logprobs": 2}, "logprobs"), ({"stop": ["x"]}, "stop"),
    ({"top_p": 0.5}, "top_p"), ({"n": 11}, "n"), ({"echo": True}, "echo"),
])
def test_beam_search_refuses_what_it_cannot_honour(f32_server: ServerThread, f32_model: str,
                                                   extra: dict[str, Any], param: str) -> None:
    body = {"model": f32_model, "prompt": PROMPT, "max_tokens": 2, "use_beam_search": True, **extra}
    with f32_server.http() as http:
        reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text


def test_return_token_ids_whole_and_streamed(f32_server: ServerThread, f32_model: str) -> None:
    """vLLM's ``return_token_ids``: each choice's generated ids (they decode to its text) and the prompt's ids
    (as /tokenize gives them); a stream carries the prompt's once and each chunk its own ids, which add up to the
    whole response's."""
    client = f32_server.openai()
    decode = f32_server.engine.tokenizer.decode
    extra = {"return_token_ids": True}
    kw: dict[str, Any] = {"model": f32_model, "max_tokens": 5, "temperature": 0, "extra_body": extra}

    whole = client.completions.create(prompt=PROMPT, n=2, **kw)
    ids = tokenize(f32_server, {"prompt": PROMPT})
    for c in whole.choices:
        assert c.model_extra["prompt_token_ids"] == ids and decode(c.model_extra["token_ids"]) == c.text
    streamed: dict[int, list[int]] = {}
    prompt_ids_seen = []
    for chunk in client.completions.create(prompt=PROMPT, stream=True, **kw):
        for c in chunk.choices:
            streamed.setdefault(c.index, []).extend(c.model_extra["token_ids"])
            if c.model_extra.get("prompt_token_ids") is not None:
                prompt_ids_seen.append(c.model_extra["prompt_token_ids"])
    assert streamed == {0: whole.choices[0].model_extra["token_ids"]} and prompt_ids_seen == [ids]

    chat = client.chat.completions.create(messages=MESSAGES, **kw)
    assert chat.model_extra["prompt_token_ids"] == tokenize(f32_server, {"messages": MESSAGES})
    assert decode(chat.choices[0].model_extra["token_ids"]) == chat.choices[0].message.content
    chunks = list(client.chat.completions.create(messages=MESSAGES, stream=True, **kw))
    assert [ch.model_extra.get("prompt_token_ids") for ch in chunks if ch.model_extra.get("prompt_token_ids")] == \
        [chat.model_extra["prompt_token_ids"]]
    assert [t for ch in chunks for c in ch.choices for t in c.model_extra.get("token_ids") or []] == \
        chat.choices[0].model_extra["token_ids"]


def test_priority_under_fcfs_is_a_400_naming_the_flag(f32_server: ServerThread, f32_model: str) -> None:
    with pytest.raises(openai.BadRequestError, match="--scheduling-policy priority"):
        f32_server.openai().completions.create(model=f32_model, prompt=PROMPT, max_tokens=1,
                                               extra_body={"priority": 1})
    assert f32_server.openai().completions.create(model=f32_model, prompt=PROMPT, max_tokens=1,
                                                  extra_body={"priority": 0}).choices[0].text is not None


def test_spaces_between_special_tokens_is_taken_and_changes_nothing(f32_server: ServerThread, f32_model: str) -> None:
    """As vLLM's detokenizer for fast tokenizers: special tokens in the text (kept by skip_special_tokens false,
    generated past the end token) read the same whether spaces between them are asked for or not."""
    texts = []
    for spaces in (True, False):
        reply = f32_server.openai().completions.create(
            model=f32_model, prompt=PROMPT, max_tokens=24, temperature=0,
            extra_body={"spaces_between_special_tokens": spaces, "skip_special_tokens": False, "ignore_eos": True,
                        "logit_bias": {"2": 100}})  # token 2 (<|im_end|>) every step: special tokens side by side
        texts.append(reply.choices[0].text)
    assert texts[0] == texts[1] and texts[0].count("<|im_end|>") >= 2
