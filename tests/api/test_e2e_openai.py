"""End to end: the official ``openai`` client (sync and async) against our server running the real engine on
the embedded SmolLM2 GGUF, once over TCP and once over a unix socket."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from tests.api.conftest import ServerThread, running, smollm2_path, tcp_bind, unix_bind

MESSAGES = [{"role": "user", "content": "Write one sentence about the sea."}]


def real_engine_cm():
    # Declared trained for 64- and 128-component vectors (Matryoshka), as vLLM's --hf-overrides declares a model.
    args = EngineArgs(model=str(smollm2_path()), mem=256, max_num_seqs=64,
                      hf_overrides={"matryoshka_dimensions": [64, 128]})
    return lambda: open_engine(args)


@pytest.fixture(scope="module", params=["tcp", "unix"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    binds = tcp_bind() if request.param == "tcp" else unix_bind(Path(tmp_path_factory.mktemp("sock")))
    with running(real_engine_cm(), ServerConfig(keepalive_s=5.0), binds) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(server: ServerThread) -> str:
    return server.openai().models.list().data[0].id


def test_chat_greedy_stream_equals_non_stream(server: ServerThread, model: str) -> None:
    client = server.openai()
    whole = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12)
    chunks = list(client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=12,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.content and text == whole.choices[0].message.content
    assert sum(c.choices[0].delta.role == "assistant" for c in chunks if c.choices) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == {**whole.usage.model_dump(),
                                                                          "prompt_tokens_details": chunks[-1].usage.prompt_tokens_details.model_dump()}
    tokenizer = server.engine.tokenizer
    prompt_ids = tokenizer.encode(tokenizer.apply_chat_template(MESSAGES), add_special_tokens=False)
    assert whole.usage.prompt_tokens == len(prompt_ids) and whole.usage.completion_tokens == 12


def test_completions_n2_logprobs_echo(server: ServerThread, model: str) -> None:
    prompt = "The capital of France is"
    r = server.openai().completions.create(model=model, prompt=[prompt, "Once upon a time"], n=2,
                                           max_tokens=5, temperature=0.8, seed=3, logprobs=3, echo=True)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    for c in r.choices:
        lp = c.logprobs
        assert lp.token_logprobs[0] is None
        assert all(x <= 0 for x in lp.token_logprobs[1:])
        assert all(3 <= len(d) <= 4 for d in lp.top_logprobs[1:])
        assert "".join(lp.tokens) == c.text
    assert r.choices[0].text.startswith(prompt) and r.choices[2].text.startswith("Once upon a time")


def test_token_id_prompts_match_text_prompts(server: ServerThread, model: str) -> None:
    tokenizer = server.engine.tokenizer
    client = server.openai()
    by_text = client.completions.create(model=model, prompt="Once upon a time", temperature=0, max_tokens=6)
    by_ids = client.completions.create(model=model, prompt=[tokenizer.encode("Once upon a time")], temperature=0,
                                       max_tokens=6)
    assert by_ids.choices[0].text == by_text.choices[0].text


def test_chat_logprobs_are_model_distribution(server: ServerThread, model: str) -> None:
    r = server.openai().chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=6,
                                                logprobs=True, top_logprobs=5)
    for t in r.choices[0].logprobs.content:
        assert len(t.top_logprobs) == 5
        # greedy: the chosen token is the most likely one
        assert t.logprob == pytest.approx(max(x.logprob for x in t.top_logprobs), abs=1e-4)
        assert sum(2.718281828 ** x.logprob for x in t.top_logprobs) <= 1.0001


def test_stop_strings_and_finish_reason(server: ServerThread, model: str) -> None:
    client = server.openai()
    free = client.completions.create(model=model, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12)
    text = free.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    r = client.completions.create(model=model, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[: text.index(stop)]
    parts = client.completions.create(model=model, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=stop,
                                      stream=True)
    assert "".join(p.choices[0].text for p in parts) == r.choices[0].text


def test_seed_reproducible_and_n2_distinct(server: ServerThread, model: str) -> None:
    client = server.openai()
    kw = {"model": model, "messages": MESSAGES, "temperature": 1.0, "max_tokens": 10, "n": 2}
    a = client.chat.completions.create(seed=1234, **kw)
    b = client.chat.completions.create(seed=1234, **kw)
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert a.choices[0].message.content != a.choices[1].message.content
    stream = client.chat.completions.create(seed=1234, stream=True, **kw)
    texts: dict[int, str] = {0: "", 1: ""}
    finishes: Counter[int] = Counter()
    for chunk in stream:
        ch = chunk.choices[0]
        texts[ch.index] += ch.delta.content or ""
        finishes[ch.index] += ch.finish_reason is not None
    assert finishes == {0: 1, 1: 1} and [texts[0], texts[1]] == [c.message.content for c in a.choices]


def test_async_client_concurrent(server: ServerThread, model: str) -> None:
    async def main() -> list[str]:
        client = server.async_openai()

        async def one(i: int) -> str:
            stream = await client.completions.create(model=model, prompt=f"Number {i}:", temperature=0,
                                                     max_tokens=6, stream=True)
            return "".join([c.choices[0].text async for c in stream])

        return await asyncio.gather(*(one(i) for i in range(6)))

    got = asyncio.run(main())
    sync = server.openai()
    want = [sync.completions.create(model=model, prompt=f"Number {i}:", temperature=0, max_tokens=6).choices[0].text
            for i in range(6)]
    assert got == want


def test_errors_raise_sdk_exceptions(server: ServerThread, model: str) -> None:
    client = server.openai()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=server.engine.max_model_len)
    assert info.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="cannot be used for structured output"):
        client.chat.completions.create(model=model, messages=MESSAGES, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {"type": "string"}}}})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, seed=-(2**63) - 1)
    assert server.metrics()["vllm:num_requests_running"] == 0


def test_echo_with_max_tokens_0_scores_the_prompt(server: ServerThread, model: str) -> None:
    """vLLM's prompt scoring: the prompt's tokens and logprobs, nothing generated, in both modes."""
    client = server.openai()
    prompt = "The capital of France is"
    n = len(server.engine.tokenizer.encode(prompt))
    kw = {"model": model, "prompt": prompt, "echo": True, "logprobs": 2, "temperature": 0}
    scored = client.completions.create(max_tokens=0, **kw)
    one = client.completions.create(max_tokens=1, **kw).choices[0].logprobs  # the prompt part is the same
    c = scored.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert c.logprobs.tokens == one.tokens[:n] and c.logprobs.text_offset == one.text_offset[:n]
    assert c.logprobs.token_logprobs[0] is None
    assert c.logprobs.token_logprobs[1:] == pytest.approx(one.token_logprobs[1:n], abs=1e-4)
    assert (scored.usage.prompt_tokens, scored.usage.completion_tokens, scored.usage.total_tokens) == (n, 0, n)

    chunks = list(client.completions.create(max_tokens=0, stream=True, stream_options={"include_usage": True}, **kw))
    choices = [ch.choices[0] for ch in chunks if ch.choices]
    assert "".join(x.text for x in choices) == prompt
    assert [t for x in choices if x.logprobs for t in x.logprobs.tokens] == c.logprobs.tokens
    assert [x.finish_reason for x in choices if x.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 0

    with pytest.raises(openai.BadRequestError, match="echo") as info:
        client.completions.create(model=model, prompt=prompt, max_tokens=0)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=0)


def test_embeddings_in_every_encoding_and_input_form(server: ServerThread, model: str) -> None:
    """The SDK's default (base64, decoded by the SDK as little-endian float32), floats, token ids, one input and a
    batch all give the same unit vectors (on the CPU, bit for bit); ``dimensions`` truncates and renormalises to
    the sizes the model is declared trained for; vLLM extras that would change the vector and are not built are
    refused."""
    client = server.openai()
    texts = ["The sea is calm tonight.", "Ships pass the headland."]
    tokenizer = server.engine.tokenizer
    ids = [tokenizer.encode(t, add_special_tokens=True) for t in texts]
    default = client.embeddings.create(model=model, input=texts)
    floats = client.embeddings.create(model=model, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    single = client.embeddings.create(model=model, input=ids[1], encoding_format="float")
    vectors = [d.embedding for d in floats.data]
    assert [d.index for d in floats.data] == [0, 1] and floats.model == model
    assert [d.embedding for d in default.data] == vectors == [d.embedding for d in by_ids.data]
    assert single.data[0].embedding == vectors[1]
    hidden = server.engine.model_config.hidden_size
    for v in vectors:
        assert len(v) == hidden and sum(x * x for x in v) == pytest.approx(1.0, abs=1e-5)
    assert sum(a * b for a, b in zip(*vectors, strict=True)) < 0.9999  # two texts, two directions
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == sum(len(i) for i in ids)
    short = client.embeddings.create(model=model, input=texts[0], dimensions=64, encoding_format="float")
    head = vectors[0][:64]
    norm = sum(x * x for x in head) ** 0.5
    assert short.data[0].embedding == pytest.approx([x / norm for x in head], abs=1e-6)
    for size in (32, hidden + 1):  # sizes the model was not trained for
        with pytest.raises(openai.BadRequestError, match=r"only supports \[64, 128\] matryoshka dimensions") as info:
            client.embeddings.create(model=model, input="hello", dimensions=size)
        assert info.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input=[])
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=model, input=[[tokenizer.vocab_size + 5]])
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=model, input="hello", extra_body={"normalize": False})
    assert info.value.body["param"] == "normalize"
    cut = client.embeddings.create(model=model, input=ids[0], encoding_format="float",
                                   extra_body={"truncate_prompt_tokens": 3})
    tail = client.embeddings.create(model=model, input=ids[0][-3:], encoding_format="float")
    assert cut.usage.prompt_tokens == 3 and cut.data[0].embedding == tail.data[0].embedding


@pytest.mark.parametrize(("content", "max_tokens"), [("Reply only with emoji: 🙂🙂🙂", 9),
                                                      ("Write Chinese characters: 你好世界", 8)])
def test_chat_logprob_bytes_rebuild_multibyte_text(server: ServerThread, model: str, content: str,
                                                   max_tokens: int) -> None:
    """Tokens holding part of a character show U+FFFD as text; their bytes must still join into the answer."""
    client = server.openai()
    kw = {"model": model, "messages": [{"role": "user", "content": content}], "temperature": 0,
          "max_tokens": max_tokens, "logprobs": True, "top_logprobs": 2}
    r = client.chat.completions.create(**kw)
    text = r.choices[0].message.content
    items = r.choices[0].logprobs.content
    # A reply that ended on the model's stop token lists that token last (as vLLM does); its text is not content.
    stopped = r.choices[0].finish_reason == "stop"
    assert not stopped or items[-1].token == "<|im_end|>"
    content_items = items[:-1] if stopped else items
    assert any(t.token == "\ufffd" for t in items), "the answer must split a character over tokens"
    assert b"".join(bytes(t.bytes) for t in content_items).decode("utf-8") == text
    assert all(top.bytes for t in items for top in t.top_logprobs)
    chunks = client.chat.completions.create(stream=True, **kw)
    streamed = [t for ch in chunks for x in ch.choices if x.logprobs for t in x.logprobs.content]
    assert b"".join(bytes(t.bytes) for t in (streamed[:-1] if stopped else streamed)).decode("utf-8") == text


def test_queue_and_prefill_times_are_recorded(server: ServerThread, model: str) -> None:
    """Every finished request observes the queue time (arrival to first scheduled) and the prefill time (first
    scheduled to first token), as it does TTFT: the scheduler's admission time reaches the metrics."""
    before = server.metrics()
    for _ in range(2):
        server.openai().completions.create(model=model, prompt="The sea is", max_tokens=3, temperature=0)
    after = server.metrics()
    for name in ("queue_time", "prefill_time"):
        key = f"vllm:request_{name}_seconds_count"
        assert after[key] - before.get(key, 0.0) == 2, name


def test_continue_final_message_goes_on_with_the_last_message(server: ServerThread, model: str) -> None:
    """vLLM's ``continue_final_message``: the prompt ends inside the prefilled assistant message, and the reply is
    what a completion of exactly that prompt (as ``/tokenize`` renders it) generates; with
    ``add_generation_prompt`` left true it is a 400, as in vLLM."""
    begun = "The capital of France is"
    messages = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": begun}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    with server.http() as http:
        tokens = http.post("/tokenize", json={"model": model, "messages": messages, **extra}).json()["tokens"]
    text = server.engine.tokenizer.decode(tokens)
    assert text.endswith(begun) and text.count(begun) == 1
    client = server.openai()
    reply = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=8,
                                           extra_body=extra).choices[0].message.content
    completion = client.completions.create(model=model, prompt=[tokens], temperature=0, max_tokens=8).choices[0].text
    assert reply and reply == completion
    with pytest.raises(openai.BadRequestError, match="continue_final_message"):
        client.chat.completions.create(model=model, messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})
