"""The OpenAI wire format through the real HTTP stack, read by the official ``openai`` client and its pydantic
types (the oracle), in front of the scripted fake engine (fast and deterministic)."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk
from tokenizers import processors

from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.tokenizer import load_tokenizer_from_gguf
from tests.api.conftest import ServerThread, engine_cm, running, smollm2_path, tcp_bind
from tests.api.fake_engine import DEFAULT_MAX_TOKENS, FakeEngine

MESSAGES = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(smol_tokenizer) -> Iterator[ServerThread]:
    engine = FakeEngine(smol_tokenizer, delay_s=0.002)
    with running(engine_cm(engine), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


def sse_events(raw: str) -> list[str]:
    """Data payloads of an SSE body, checking the framing: events are ``data: ...`` or ``:`` comments."""
    events = []
    for block in raw.split("\n\n"):
        if not block:
            continue
        assert block.startswith(("data: ", ":")), block
        if block.startswith("data: "):
            events.append(block[len("data: "):])
    return events


def test_chat_non_stream_n2_logprobs(server: ServerThread, smol_tokenizer) -> None:
    r = server.openai().chat.completions.create(model="fake-model", messages=MESSAGES, n=2, logprobs=True,
                                                top_logprobs=3, max_completion_tokens=4, max_tokens=50)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content != r.choices[1].message.content
    prompt = smol_tokenizer.encode(smol_tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert r.usage.completion_tokens == 2 * 4  # max_completion_tokens wins over max_tokens
    assert r.usage.total_tokens == len(prompt) + 8
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    for choice in r.choices:
        assert choice.finish_reason == "length"
        content = choice.logprobs.content
        assert len(content) == 4
        assert "".join(t.token for t in content) == choice.message.content
        for t in content:
            assert len(t.top_logprobs) == 3
            assert t.bytes == list(t.token.encode())
            assert [x.logprob for x in t.top_logprobs] == sorted((x.logprob for x in t.top_logprobs), reverse=True)
            assert t.logprob <= 0


def test_chat_stream_invariants(server: ServerThread) -> None:
    with server.http() as http:
        raw = http.post("/v1/chat/completions", json={
            "model": "fake-model", "messages": MESSAGES, "n": 2, "stream": True, "max_tokens": 5,
            "stream_options": {"include_usage": True}, "logprobs": True, "top_logprobs": 0,
            "some_unknown_field": {"x": 1}}).text
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(e) for e in events[:-1]]
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    roles: Counter[int] = Counter()
    finishes: Counter[int] = Counter()
    text: dict[int, str] = {0: "", 1: ""}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        ch = c.choices[0]
        roles[ch.index] += ch.delta.role == "assistant"
        finishes[ch.index] += ch.finish_reason is not None
        text[ch.index] += ch.delta.content or ""
        if ch.delta.content:
            assert ch.logprobs is not None and all(t.top_logprobs == [] for t in ch.logprobs.content)
    assert roles == {0: 1, 1: 1} and finishes == {0: 1, 1: 1}
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == 10
    assert text[0] and text[1]


def test_stream_equals_non_stream(server: ServerThread) -> None:
    client = server.openai()
    whole = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=6)
    parts = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=6, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in parts if c.choices) == whole.choices[0].message.content


def test_completions_batch_echo_logprobs(server: ServerThread, smol_tokenizer) -> None:
    prompts = ["The sky is", "One two three"]
    r = server.openai().completions.create(model="fake-model", prompt=prompts, n=2, echo=True, logprobs=2,
                                           max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        prompt = prompts[c.index // 2]
        ids = smol_tokenizer.encode(prompt)
        assert c.text.startswith(prompt)
        lp = c.logprobs
        assert len(lp.tokens) == len(ids) + 3
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(isinstance(x, float) for x in lp.token_logprobs[1:])
        assert all(2 <= len(d) <= 3 for d in lp.top_logprobs[1:])
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
        assert "".join(lp.tokens) == c.text
    assert r.usage.prompt_tokens == sum(len(smol_tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 3


def test_completions_token_prompts_stream(server: ServerThread, smol_tokenizer) -> None:
    ids = [smol_tokenizer.encode("hello world"), smol_tokenizer.encode("good night")]
    with server.http() as http:
        raw = http.post("/v1/completions", json={"prompt": ids, "stream": True, "max_tokens": 4,
                                                 "stream_options": {"include_usage": True}}).text
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    # the SDK builds completion chunks without validation (finish_reason is null mid-stream)
    chunks = [Completion.model_construct(**json.loads(e)) for e in events[:-1]]
    assert all(c.object == "text_completion" for c in chunks)
    finishes = Counter(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finishes == {0: 1, 1: 1}
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(ids[0]) + len(ids[1])


def test_single_token_id_prompt(server: ServerThread, smol_tokenizer) -> None:
    ids = smol_tokenizer.encode("hello")
    r = server.openai().completions.create(model="fake-model", prompt=ids, max_tokens=2)
    assert r.usage.prompt_tokens == len(ids) and len(r.choices) == 1


def test_truncate_prompt_tokens_cuts_the_prompt_before_its_checks(server: ServerThread, smol_tokenizer) -> None:
    """vLLM's ``truncate_prompt_tokens`` on both generation routes: the engine gets the prompt's last k ids (a
    chat's rendered prompt too), usage counts them, echo shows their text; past the context it is a 400."""
    ids = smol_tokenizer.encode("one two three four five six seven eight")
    client = server.openai()
    r = client.completions.create(model="fake-model", prompt=ids, max_tokens=2, echo=True,
                                  extra_body={"truncate_prompt_tokens": 3})
    assert server.engine.seen_prompts[-1] == ids[-3:] and r.usage.prompt_tokens == 3
    assert r.choices[0].text.startswith(smol_tokenizer.decode(ids[-3:], skip_special_tokens=False))
    chat = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=2,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert len(server.engine.seen_prompts[-1]) == 4 and chat.usage.prompt_tokens == 4
    for route, body in (("/v1/completions", {"prompt": ids}), ("/v1/chat/completions", {"messages": MESSAGES})):
        with server.http() as http:
            r = http.post(route, json={**body, "max_tokens": 2, "truncate_prompt_tokens": 513})
        assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", route


def test_allowed_token_ids_and_bad_words_reach_the_engine(server: ServerThread, smol_tokenizer) -> None:
    client = server.openai()
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=2,
                                   extra_body={"allowed_token_ids": [7, 3, 7]})
    assert server.engine.seen_params[-1].allowed_token_ids == [3, 7]
    client.completions.create(model="fake-model", prompt="hi", max_tokens=2, extra_body={"bad_words": ["sea"]})
    assert server.engine.seen_params[-1].bad_words == ["sea"]
    for bad in ([], [smol_tokenizer.vocab_size]):
        with pytest.raises(openai.BadRequestError, match="allowed_token_ids") as info:
            client.completions.create(model="fake-model", prompt="hi", max_tokens=2,
                                      extra_body={"allowed_token_ids": bad})
        assert info.value.param == "allowed_token_ids"


def test_default_max_tokens_left_to_engine(server: ServerThread) -> None:
    r = server.openai().chat.completions.create(model="fake-model", messages=MESSAGES)
    assert r.usage.completion_tokens == DEFAULT_MAX_TOKENS
    assert server.engine.seen_params[-1].max_tokens is None


def test_sampling_fields_reach_engine(server: ServerThread) -> None:
    server.openai().chat.completions.create(
        model="fake-model", messages=MESSAGES, max_tokens=2, temperature=0.5, top_p=0.9, seed=7, stop=["x", "y"],
        frequency_penalty=0.5, logit_bias={"42": 3.0}, extra_body={"top_k": 5, "min_p": 0.1, "ignore_eos": True,
                                                                   "repetition_penalty": 1.1, "min_tokens": 1})
    p = server.engine.seen_params[-1]
    assert (p.temperature, p.top_p, p.seed, p.stop, p.top_k, p.min_p) == (0.5, 0.9, 7, ["x", "y"], 5, 0.1)
    assert (p.ignore_eos, p.repetition_penalty, p.min_tokens, p.frequency_penalty) == (True, 1.1, 1, 0.5)
    assert p.logit_bias == {42: 3.0}
    assert p.explicit_fields >= {"temperature", "top_p", "seed"} and "presence_penalty" not in p.explicit_fields


def test_models_and_small_routes(server: ServerThread, smol_tokenizer) -> None:
    models = server.openai().models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    card = models.data[0].model_dump()
    assert card["max_model_len"] == 512 and card["owned_by"] and isinstance(card["created"], int)
    with server.http() as http:
        assert http.get("/health").status_code == 200 and http.get("/health").text == ""
        assert http.get("/version").json()["version"]
        tok = http.post("/tokenize", json={"prompt": "Hello there", "return_token_strs": True}).json()
        assert tok["tokens"] == smol_tokenizer.encode("Hello there") and tok["count"] == len(tok["tokens"])
        assert "".join(tok["token_strs"]) == "Hello there"
        assert http.post("/detokenize", json={"tokens": tok["tokens"]}).json()["prompt"] == "Hello there"
        chat = http.post("/tokenize", json={"messages": MESSAGES}).json()
        assert chat["tokens"] == smol_tokenizer.encode(smol_tokenizer.apply_chat_template(MESSAGES),
                                                       add_special_tokens=False)
        info = http.get("/tokenizer_info").json()
        assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == smol_tokenizer.chat_template
        spec = http.get("/openapi.json").json()
        assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/metrics"} <= set(spec["paths"])


def test_metrics_count_requests(server: ServerThread) -> None:
    before = server.metrics()
    for _ in range(3):
        server.openai().completions.create(model="fake-model", prompt="abc", max_tokens=4)
    after = server.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert delta["vllm:time_to_first_token_seconds_count"] == 3
    assert delta["vllm:inter_token_latency_seconds_count"] == 3 * (4 - 1)
    assert delta["vllm:e2e_request_latency_seconds_count"] == 3
    assert delta["vllm:generation_tokens_total"] == 12
    assert delta['vllm:request_success_total{finished_reason="length"}'] == 3
    assert after["vllm:num_requests_running"] == 0 and after["vllm:kv_cache_usage_perc"] == 0


def test_metrics_count_embeddings_without_generation(server: ServerThread) -> None:
    """A pooling request counts its prompt and its end (``stop``), no generated tokens and no decode phase."""
    server.openai().completions.create(model="fake-model", prompt="abc", max_tokens=2)  # every series exists
    before = server.metrics()
    r = server.openai().embeddings.create(model="fake-model", input=["abc", "de"], encoding_format="float")
    after = server.metrics()
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    assert len(r.data) == 2 and delta["vllm:prompt_tokens_total"] == r.usage.prompt_tokens > 0
    assert delta['vllm:request_success_total{finished_reason="stop"}'] == 2
    assert delta["vllm:e2e_request_latency_seconds_count"] == 2
    for series in ("vllm:generation_tokens_total", "vllm:request_generation_tokens_count",
                   "vllm:request_decode_time_seconds_count", "vllm:time_to_first_token_seconds_count"):
        assert delta[series] == 0, series


def test_dimensions_on_a_model_not_trained_for_them_is_vllms_400(server: ServerThread) -> None:
    """The fake model declares no Matryoshka sizes: the error body is vLLM's, with the way to declare them."""
    with server.http() as http:
        r = http.post("/v1/embeddings", json={"input": "abc", "dimensions": 8})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "dimensions"
    assert error["message"].startswith('Model "fake-model" does not support matryoshka representation')
    assert "--hf-overrides" in error["message"]


def test_raw_sse_is_valid_json_and_done(server: ServerThread) -> None:
    with server.http() as http:
        raw = http.post("/v1/completions", json={"prompt": "x", "stream": True, "max_tokens": 2}).text
    events = sse_events(raw)
    assert events[-1] == "[DONE]" and all(json.loads(e)["object"] == "text_completion" for e in events[:-1])


def test_server_flag_names_tokens_by_id_unless_the_request_says_no(smol_tokenizer) -> None:
    """``--return-tokens-as-token-ids`` is every request's default; a request's own false wins, as in vLLM."""
    engine = FakeEngine(smol_tokenizer, delay_s=0.0)
    with running(engine_cm(engine), ServerConfig(return_tokens_as_token_ids=True), tcp_bind()) as srv:
        client = srv.openai()
        chat = client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=3, logprobs=True,
                                              top_logprobs=1).choices[0]
        ids = [int(t.token.removeprefix("token_id:")) for t in chat.logprobs.content]
        assert smol_tokenizer.decode(ids) == chat.message.content
        done = client.completions.create(model="fake-model", prompt="hi", max_tokens=3, logprobs=1,
                                         extra_body={"return_tokens_as_token_ids": False}).choices[0]
        assert "".join(done.logprobs.tokens) == done.text and not any("token_id:" in t for t in done.logprobs.tokens)


def _chat_text(server: ServerThread, messages: list[dict[str, Any]], stream: bool, **extra: Any) -> str:
    kw = {"model": "fake-model", "messages": messages, "max_tokens": 3, "extra_body": extra}
    client = server.openai()
    if not stream:
        return client.chat.completions.create(**kw).choices[0].message.content or ""
    chunks = list(client.chat.completions.create(stream=True, **kw))
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_chat_echo_starts_the_reply_with_the_last_message_of_its_role(server: ServerThread, stream: bool) -> None:
    """vLLM's chat ``echo``: a continued assistant message comes back whole (its text parts joined by newlines);
    a user message is not the reply's role, so nothing is echoed; the generated part is the same either way."""
    head = [{"role": "user", "content": "Name a colour."}]
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    for prefix, content in (("The colour is", "The colour is"),
                            ("Red\nor blue", [{"type": "text", "text": "Red"}, {"type": "text", "text": "or blue"}])):
        messages = [*head, {"role": "assistant", "content": content}]
        plain = _chat_text(server, messages, stream, **cont)
        assert plain and _chat_text(server, messages, stream, echo=True, **cont) == prefix + plain
    assert _chat_text(server, head, stream, echo=True) == _chat_text(server, head, stream)


def test_add_special_tokens_as_vllm_defaults_them() -> None:
    """Completions add the tokenizer's special tokens (BOS) unless ``add_special_tokens`` is false; chat prompts,
    whose templates write them, get none unless it is true (a tokenizer that adds a BOS shows the difference)."""
    tokenizer = load_tokenizer_from_gguf(smollm2_path())
    bos = tokenizer.token_to_id("<|im_start|>")
    tokenizer.hf.post_processor = processors.TemplateProcessing(single="<|im_start|> $A",
                                                               special_tokens=[("<|im_start|>", bos)])
    engine = FakeEngine(tokenizer, delay_s=0.0)
    with running(engine_cm(engine), ServerConfig(), tcp_bind()) as srv:
        client = srv.openai()
        for flag in (None, False, True):
            extra = {} if flag is None else {"add_special_tokens": flag}
            client.completions.create(model="fake-model", prompt="hi there", max_tokens=1, extra_body=extra)
            client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1, extra_body=extra)
            with srv.http() as http:  # /tokenize reports the ids the two routes run
                by_prompt = http.post("/tokenize", json={"prompt": "hi there", **extra}).json()["tokens"]
                by_messages = http.post("/tokenize", json={"messages": MESSAGES, **extra}).json()["tokens"]
            assert [by_prompt, by_messages] == engine.seen_prompts[-2:]
    plain = tokenizer.encode("hi there", add_special_tokens=False)
    chat = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert engine.seen_prompts == [[bos, *plain], chat, plain, chat, [bos, *plain], [bos, *chat]]


def test_sagemaker_routes_and_load(server: ServerThread) -> None:
    """vLLM's ``/ping`` (GET and POST, as /health), ``/load`` (requests in flight) and ``/invocations``, which
    answers each body as the route its fields name would, and refuses a body that names none."""
    with server.http() as http:
        assert [http.get("/ping").status_code, http.post("/ping").status_code] == [200, 200]
        assert http.get("/load").json() == {"server_load": 0}
        chat = http.post("/invocations", json={"messages": MESSAGES, "max_tokens": 3, "temperature": 0}).json()
        direct = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "temperature": 0})
        assert chat["object"] == "chat.completion"
        assert chat["choices"][0]["message"] == direct.json()["choices"][0]["message"]
        done = http.post("/invocations", json={"prompt": "the cat", "max_tokens": 2}).json()
        assert done["object"] == "text_completion" and done["usage"]["completion_tokens"] == 2
        vectors = http.post("/invocations", json={"input": "the cat", "encoding_format": "float"}).json()
        assert vectors["object"] == "list" and len(vectors["data"][0]["embedding"]) == 16
        answer = http.post("/invocations", json={"input": "the cat", "max_output_tokens": 2}).json()
        assert answer["object"] == "response" and answer["usage"]["output_tokens"] == 2  # a Responses body
        refused = http.post("/invocations", json={"question": "?"})
        assert refused.status_code == 400 and "messages" in refused.json()["error"]["message"]


def test_priority_reaches_the_engine(server: ServerThread) -> None:
    """vLLM's ``priority`` goes to the engine with each request (the engine's policy decides whether it may be
    other than 0); a non-integer is a 400."""
    engine: FakeEngine = server.engine
    client = server.openai()
    client.completions.create(model="fake-model", prompt="the cat", max_tokens=1, extra_body={"priority": -3})
    client.chat.completions.create(model="fake-model", messages=MESSAGES, max_tokens=1, extra_body={"priority": 7})
    assert engine.seen_priorities[-2:] == [-3, 7]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="fake-model", prompt="x", max_tokens=1, extra_body={"priority": "high"})
    assert info.value.body["param"] == "priority"
