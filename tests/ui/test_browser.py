"""The chat page in a real headless Chromium: streamed markdown, reasoning, settings, copy, stop, regenerate,
conversations kept across reloads; and ``candle-vllm --ui-server`` serving it with the real model."""

from __future__ import annotations

import json
import random
import re
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from playwright.sync_api import expect

from tests.ui.conftest import UIStack, screenshot, wait_until

CODE = 'def greet(name):\n    return f"Hello, {name}!"\n'
STORED = "JSON.parse(localStorage.getItem('candle-vllm.conversations'))"


def set_settings(page: Any, **fields: str | bool) -> None:
    page.click("#settings-button")
    for name, value in fields.items():
        selector = f"#set-{name.replace('_', '-')}"
        if isinstance(value, bool):
            page.set_checked(selector, value)
        else:
            page.fill(selector, value)
    page.click("#save-settings")


def send(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def wait_idle(page: Any) -> None:
    page.wait_for_selector("body[data-state=idle] .message.assistant .actions", state="visible")


@pytest.mark.parametrize("ui_stack", [{"delay_s": 0.03}], indirect=True)
def test_streamed_reply_renders_as_markdown_with_reasoning(ui_stack: UIStack, page: Any) -> None:
    page.context.grant_permissions(["clipboard-read", "clipboard-write"])
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    set_settings(page, system="You are terse.", temperature="0.3", top_p="0.9", max_tokens="500", thinking=False)
    send(page, "Say hello")

    # Rendered while still streaming: the heading is markup before the reply has finished.
    page.wait_for_selector("body[data-state=running] .message.assistant .content h1")
    wait_idle(page)
    answer = page.locator(".message.assistant .content")
    assert answer.locator("h1").inner_text() == "Greeting"
    assert answer.locator("strong").inner_text() == "bold"
    assert answer.locator("li").all_inner_texts() == ["first", "second"]
    assert answer.locator("td").all_inner_texts() == ["python", "hello.py"]
    assert page.locator(".codeblock .lang").inner_text() == "python"
    assert page.locator(".codeblock code").text_content() == CODE
    assert page.locator(".codeblock code span.k").first.inner_text() == "def"  # highlighted by Pygments
    assert "<think>" not in answer.inner_text() and "greeting function" not in answer.inner_text()
    reasoning = page.locator(".message.assistant details.reasoning")
    assert reasoning.is_visible() and reasoning.get_attribute("open") is None  # shown collapsed
    reasoning.locator("summary").click()
    assert reasoning.locator(".markdown").inner_text() == "The user wants a greeting function."

    page.click(".codeblock button.copy")
    expect(page.locator(".codeblock button.copy")).to_have_text("Copied")
    assert page.evaluate("navigator.clipboard.readText()") == CODE

    (seen,) = ui_stack.engine.requests
    assert (seen.params.temperature, seen.params.top_p, seen.params.max_tokens) == (0.3, 0.9, 500)
    assert "You are terse." in seen.prompt and "Say hello" in seen.prompt
    assert screenshot(page, "ui.png").stat().st_size > 10_000

    page.reload()  # the conversation lives in this browser
    page.wait_for_selector(".message.assistant .content h1")
    assert page.locator("#conversations .open").all_inner_texts() == ["Say hello"]
    stored = page.evaluate(STORED)
    assert [m["role"] for m in stored[0]["messages"]] == ["user", "assistant"]
    assert page.errors == []


def start_long_reply(ui_stack: UIStack, page: Any) -> None:
    """Ask for a long reply and wait until it is partway through its stream."""
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    set_settings(page, max_tokens="3000")
    send(page, "Tell me everything")
    page.wait_for_selector(".message.assistant .content h1")


@pytest.mark.parametrize("ui_stack", [{"delay_s": 0.02, "repeat": True}], indirect=True)
def test_stop_aborts_the_generation_and_regenerate_asks_again(ui_stack: UIStack, page: Any) -> None:
    engine = ui_stack.engine
    start_long_reply(ui_stack, page)
    page.click("#stop")
    wait_idle(page)
    assert page.locator(".message.assistant .status").inner_text() == "Stopped."
    first = engine.requests[0].request_id
    wait_until(lambda: first in engine.aborted and not engine.running)  # the disconnect reached the engine
    shown = page.evaluate(STORED)[0]["messages"][1]["content"]
    assert 0 < len(engine.tokenizer.encode(shown, add_special_tokens=False)) < 3000

    page.click(".message.assistant button.regenerate")
    page.wait_for_selector("body[data-state=running]")
    wait_until(lambda: len(engine.requests) == 2)
    page.click("#stop")
    wait_idle(page)
    assert engine.requests[1].prompt == engine.requests[0].prompt  # the same history, asked again
    assert page.locator(".message.assistant").count() == 1  # the new reply replaced the old one
    assert page.errors == []


@pytest.mark.parametrize("ui_stack", [{"delay_s": 0.02, "repeat": True}], indirect=True)
def test_a_reload_mid_reply_keeps_the_text_as_stopped(ui_stack: UIStack, page: Any) -> None:
    """Reloading while a reply streams keeps what had arrived, marked stopped (it was an empty, unfinished turn
    that the next request sent back as an empty assistant message)."""
    engine = ui_stack.engine
    start_long_reply(ui_stack, page)
    page.reload()
    expect(page.locator("#model-name")).to_have_text("fake-model")
    expect(page.locator(".message.assistant .status")).to_have_text("Stopped.")
    reply = page.evaluate(STORED)[0]["messages"][1]
    assert reply["content"] and reply["finish"] == "stopped", {k: reply[k] for k in ("finish", "error")}
    wait_until(lambda: not engine.running)


STEPS = " ".join(f"Step {i}." for i in range(25))


@pytest.mark.parametrize("ui_stack", [{"delay_s": 0.03, "think_template": True,
                                       "script": f"<think>{STEPS}</think>\n\nThe answer is **42**."}],
                         indirect=True)
def test_server_split_reasoning_streams_into_the_collapsed_block(ui_stack: UIStack, page: Any) -> None:
    """The API splits the reply (its template names </think>): reasoning arrives as ``reasoning_content``
    deltas and fills the collapsed block while the model is still reasoning, before any answer."""
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    send(page, "Think it through")
    details = page.locator("body[data-state=running] .message.assistant details.reasoning")
    expect(details.locator(".markdown")).to_contain_text("Step 1.")
    expect(details.locator("summary")).to_have_text("Reasoning…")
    assert details.is_visible() and details.get_attribute("open") is None  # streaming in, collapsed
    assert "Step 24." not in details.locator(".markdown").text_content()
    assert page.locator(".message.assistant .content").inner_text() == ""  # no answer yet

    wait_idle(page)
    done = page.locator(".message.assistant details.reasoning")
    expect(done.locator("summary")).to_have_text("Reasoning")
    expect(page.locator(".message.assistant .content strong")).to_have_text("42")
    stored = page.evaluate(STORED)[0]["messages"][1]
    assert stored["reasoning"] == STEPS  # from reasoning_content deltas: the server did the split
    assert stored["content"] == "\n\nThe answer is **42**."
    done.locator("summary").click()
    assert done.locator(".markdown").inner_text() == STEPS
    assert page.errors == []


WEATHER = {"city": "<img src=x onerror=alert(1)> Paris & \"Lyon\"", "unit": "fahrenheit", "days": 2}
ADD = {"a": 2, "b": 40}
TOOL_SCRIPT = "".join(f"\n<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>"
                      for n, a in (("local_get_weather", WEATHER), ("local_add", ADD)))
RECORD_ARGS = """() => {
  window.argsSeen = [];
  new MutationObserver(() => {
    const text = document.querySelector('.message.assistant .tool-call .tool-args')?.textContent;
    if (text !== undefined && text !== window.argsSeen.at(-1)) window.argsSeen.push(text);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
}"""


@pytest.mark.parametrize("ui_stack", [{"delay_s": 0.03, "mcp": True, "script": "I will check." + TOOL_SCRIPT}],
                         indirect=True)
def test_tool_calls_stream_into_blocks_under_the_answer(ui_stack: UIStack, page: Any) -> None:
    """The API offers the MCP demo server's tools and reads the scripted calls (``qwen`` parser): the page
    shows each call as a block (name, arguments pretty-printed as text) growing with the argument fragments,
    holding what the official client gets for the same request."""
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    page.evaluate(RECORD_ARGS)
    send(page, "Weather in Paris, and 2 + 40?")
    page.wait_for_selector("body[data-state=running] .message.assistant .tool-call .tool-name")
    wait_idle(page)

    blocks = page.locator(".message.assistant .tool-call")
    assert blocks.locator(".tool-name").all_inner_texts() == ["local_get_weather", "local_add"]
    shown = blocks.locator(".tool-args").all_text_contents()
    assert shown == [json.dumps(WEATHER, indent=2, ensure_ascii=False), json.dumps(ADD, indent=2)]
    assert page.locator(".message.assistant .tool-calls img").count() == 0  # text, never markup
    seen = page.evaluate("window.argsSeen")
    partial = [text for text in seen if text != shown[0]]
    assert len(partial) >= 5 and all(shown[0].startswith(text) for text in seen)  # it grew fragment by fragment
    assert page.locator(".message.assistant .content").inner_text() == "I will check."
    assert page.locator(".message.assistant .status").inner_text() == ""
    assert screenshot(page, "ui-tool-calls.png").stat().st_size > 10_000

    # Oracle: the same request through the official client, not streamed.
    client = openai.OpenAI(base_url=f"{ui_stack.urls[0]}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model="fake-model", messages=[
        {"role": "user", "content": "Weather in Paris, and 2 + 40?"}])
    assert reply.choices[0].finish_reason == "tool_calls"  # calls are read only when tools (MCP's) are offered
    stored = page.evaluate(STORED)[0]["messages"][1]
    assert stored["finish"] == "tool_calls"
    assert [(c["type"], c["function"]["name"], c["function"]["arguments"]) for c in stored["tool_calls"]] == [
        (c.type, c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls]
    assert len({c["id"] for c in stored["tool_calls"]}) == 2
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c["id"]) for c in stored["tool_calls"])

    page.reload()  # the calls are kept with the conversation
    expect(page.locator(".message.assistant .tool-call .tool-args")).to_have_text(shown)
    assert page.errors == []


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(7 if depth < 3 else 4)
    if kind == 0:
        return rng.choice([True, False, None, "", "a \"q\" \\ {x: [1]}, \n\t", "ünï 😀 <b>&amp;</b>"])
    if kind == 1:
        return rng.randint(-10**6, 10**6)
    if kind == 2:
        return rng.uniform(-1e3, 1e3)
    if kind == 3:
        return "".join(rng.choice("ab ,:{}[]\"\\") for _ in range(rng.randrange(6)))
    if kind in (4, 5):
        return {f"k{i}{rng.choice(['', ' ', ':', ','])}": _random_json(rng, depth + 1) for i in range(rng.randrange(4))}
    return [_random_json(rng, depth + 1) for _ in range(rng.randrange(4))]


def test_arguments_are_pretty_printed_as_python_json_does_and_only_grow(ui_stack: UIStack, page: Any) -> None:
    rng = random.Random(7)
    values = [_random_json(rng) for _ in range(60)] + [{}, [], {"a": {}, "b": [[]]}]
    texts = [json.dumps(v, ensure_ascii=False, separators=rng.choice([(",", ":"), (", ", ": "), (" ,\n", " :  ")]))
             for v in values]
    page.goto(ui_stack.ui_url)
    got = page.evaluate("""async (texts) => {
      const { prettyJSON } = await import('/static/tool_calls.js');
      return texts.map((t) => {
        const whole = prettyJSON(t);
        const cuts = [...t].map((_, k) => prettyJSON([...t].slice(0, k).join('')));
        return [whole, cuts.every((c) => whole.startsWith(c))];
      });
    }""", texts)
    assert [whole for whole, _ in got] == [json.dumps(v, indent=2, ensure_ascii=False) for v in values]
    assert all(grows for _, grows in got)


def sse(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ": ping\n\ndata: [DONE]\n\n"


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": "stop" if not fields else None}]}


def fulfill_stream(route: Any, body: str) -> None:
    """Answer an intercepted chat request with an event stream, as the API would (CORS included)."""
    route.fulfill(status=200, headers={"Access-Control-Allow-Origin": "*", "Content-Type": "text/event-stream"},
                  body=body)


def test_reasoning_deltas_thinking_switch_and_api_errors(ui_stack: UIStack, page: Any) -> None:
    """The page against hand-written API answers: ``reasoning_content`` deltas, an error body."""
    bodies: list[dict[str, Any]] = []
    cors = {"Access-Control-Allow-Origin": "*"}

    def answer(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        if len(bodies) == 1:
            fulfill_stream(route, sse(delta(role="assistant", reasoning_content="Step **one**."),
                                      delta(content="Answer `x`"), delta()))
        else:
            route.fulfill(status=401, headers={**cors, "Content-Type": "application/json"},
                          body=json.dumps({"error": {"message": "missing or wrong API key"}}))

    page.route("**/v1/chat/completions", answer)
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    set_settings(page, thinking=False)
    send(page, "Think first")
    wait_idle(page)
    reasoning = page.locator(".message.assistant details.reasoning .markdown")
    expect(reasoning.locator("strong")).to_have_text("one")
    expect(page.locator(".message.assistant .content code")).to_have_text("x")
    assert bodies[0]["chat_template_kwargs"] == {"enable_thinking": False} and bodies[0]["stream"] is True
    assert bodies[0]["messages"] == [{"role": "user", "content": "Think first"}]

    send(page, "Again")
    wait_idle(page)
    expect(page.locator(".message.assistant .status.error").last).to_have_text(
        "Error: missing or wrong API key (set the API key in Settings)")
    # The earlier answer goes back without its reasoning; the failed reply is not sent.
    assert bodies[1]["messages"][1:] == [{"role": "assistant", "content": "Answer `x`"},
                                         {"role": "user", "content": "Again"}]


@pytest.mark.parametrize("ui_stack", [{"ipv6": True}], indirect=True)
def test_the_page_reaches_the_api_over_ipv6(ui_stack: UIStack, page: Any) -> None:
    """Served on [::1], the page builds the API's address with one pair of brackets (it had two: no model)."""
    assert "[::1]" in ui_stack.ui_url
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    send(page, "Hello")
    wait_idle(page)
    expect(page.locator(".message.assistant .status.error")).to_have_count(0)


def test_cut_streams_failed_turns_settings_and_new_chats(ui_stack: UIStack, page: Any) -> None:
    """A stream that ends without [DONE] is an error, not a finished reply; a failed turn is left out of the next
    request with the user turn it answered (no two user turns in a row); temperatures between the spinner's steps
    are kept; "New chat" twice leaves one empty conversation."""
    bodies: list[dict[str, Any]] = []

    def answer(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        body = sse(delta(content="fine"), delta())
        if len(bodies) == 1:
            body = f"data: {json.dumps(delta(content='cut off here'))}\n\n"  # no finish, no [DONE]
        fulfill_stream(route, body)

    page.route("**/v1/chat/completions", answer)
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    set_settings(page, temperature="0.33")
    send(page, "First")
    wait_idle(page)
    expect(page.locator(".message.assistant .status.error")).to_have_text(
        "Error: the connection closed before the reply finished")
    send(page, "Second")
    wait_idle(page)
    assert bodies[1]["messages"] == [{"role": "user", "content": "Second"}]
    assert bodies[0]["temperature"] == bodies[1]["temperature"] == 0.33
    page.click("#new-chat")
    page.click("#new-chat")
    titles = page.evaluate(f"{STORED}.map((c) => c.messages.length)")
    assert sorted(titles) == [0, 4], titles


def test_a_prompt_sent_right_after_save_takes_the_new_settings(ui_stack: UIStack, page: Any) -> None:
    """Save, then Enter in the same task: the request carries the saved temperature and max tokens (they were stored
    on the dialog's close event, a task later, and the real-model chat test once went out at the defaults)."""
    bodies: list[dict[str, Any]] = []

    def answer(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        fulfill_stream(route, sse(delta(content="fine"), delta()))

    page.route("**/v1/chat/completions", answer)
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    page.click("#settings-button")
    page.fill("#set-temperature", "0.25")
    page.fill("#set-max-tokens", "7")
    page.evaluate("""() => {
        document.getElementById("save-settings").click();
        const prompt = document.getElementById("prompt");
        prompt.value = "Right away";
        prompt.dispatchEvent(new KeyboardEvent("keydown", { key: "Enter", bubbles: true, cancelable: true }));
    }""")
    wait_idle(page)
    assert [(b["temperature"], b.get("max_tokens")) for b in bodies] == [(0.25, 7)]


def test_enter_in_a_settings_field_saves_and_cancel_does_not(ui_stack: UIStack, page: Any) -> None:
    """Enter in a field submits the settings form with Save, its one submit button (it used to take Cancel, the
    first); Cancel closes the dialog and keeps what was saved."""
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    stored = "JSON.parse(localStorage.getItem('candle-vllm.settings'))"
    page.click("#settings-button")
    page.fill("#set-temperature", "0.4")
    page.press("#set-temperature", "Enter")
    expect(page.locator("#settings")).not_to_be_visible()
    assert page.evaluate(stored)["temperature"] == 0.4
    page.click("#settings-button")
    page.fill("#set-temperature", "1.5")
    page.click("#cancel-settings")
    expect(page.locator("#settings")).not_to_be_visible()
    assert page.evaluate(stored)["temperature"] == 0.4


def test_stop_works_while_the_page_connects(ui_stack: UIStack, page: Any) -> None:
    """A reply waiting for the page's connection to the API stops on Stop, without sending anything."""
    held: list[Any] = []
    sent: list[str] = []
    page.route("**/config.json", lambda route: held.append(route))
    page.route("**/v1/chat/completions", lambda route: (sent.append(route.request.url), route.abort()))
    page.goto(ui_stack.ui_url)
    send(page, "Early")
    page.click("#stop")
    wait_idle(page)
    expect(page.locator(".message.assistant .status")).to_have_text("Stopped.")
    assert held and sent == []


def test_a_prompt_sent_before_the_page_connects_waits_for_the_api(ui_stack: UIStack, page: Any) -> None:
    """A prompt sent while the page still reads /config.json (where the API is) goes to the API once it is known,
    not to the UI server's own origin."""
    held: list[Any] = []
    urls: list[str] = []

    def answer(route: Any) -> None:
        urls.append(route.request.url)
        fulfill_stream(route, sse(delta(content="fine"), delta()))

    page.route("**/config.json", lambda route: held.append(route))
    page.route("**/v1/chat/completions", answer)
    page.goto(ui_stack.ui_url)
    send(page, "Early")
    for _ in range(500):  # the route's handler runs as Playwright dispatches events, which its waits do
        if held:
            break
        page.wait_for_timeout(20)
    held[0].continue_()
    wait_idle(page)
    assert urls == [f"{ui_stack.urls[0]}/v1/chat/completions"]
    expect(page.locator(".message.assistant .content")).to_have_text("fine")


@pytest.mark.parametrize(
    ("text", "reasoning", "answer", "thinking"),
    [
        ("<think>plan</think>\n\nreply", "plan", "reply", False),
        ("<think>still going", "still going", "", True),
        ("opened by the template</think>reply", "opened by the template", "reply", False),
        ("plain reply", "", "plain reply", False),
        ("a <think>b</think> c", "b", "a  c", False),
    ],
)
def test_reasoning_split(ui_stack: UIStack, page: Any, text: str, reasoning: str, answer: str,
                         thinking: bool) -> None:
    page.goto(ui_stack.ui_url)
    got = page.evaluate("async (t) => (await import('/static/stream.js')).splitReasoning(t)", text)
    assert got == {"reasoning": reasoning, "answer": answer, "thinking": thinking}


def free_port_pair() -> int:
    """A port P with P and P-1 free (the API and the UI), as far as binding them now tells."""
    for _ in range(50):
        with socket.socket() as api:
            api.bind(("127.0.0.1", 0))
            port = api.getsockname()[1]
            with socket.socket() as ui:
                try:
                    ui.bind(("127.0.0.1", port - 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no free pair of adjacent ports")


@pytest.fixture
def cli_server(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    exe = shutil.which("candle-vllm")
    assert exe is not None, "the candle-vllm console script is not installed (pip install -e .)"
    port = free_port_pair()
    proc = subprocess.Popen([exe, "--cpu", "--h", "127.0.0.1", "--p", str(port), "--mem", "64", "--ui-server"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if match := re.search(r"UI: (http://\S+/)", line):
                break
        assert match, "".join(lines)
        assert f"API: http://127.0.0.1:{port}/v1" in "".join(lines)
        assert match.group(1) == f"http://127.0.0.1:{port - 1}/"
        yield proc, f"http://127.0.0.1:{port}", match.group(1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_cli_ui_server_chats_with_the_real_model(cli_server: tuple[subprocess.Popen[str], str, str],
                                                  page: Any) -> None:
    proc, api_url, ui_url = cli_server
    page.goto(ui_url)
    expect(page.locator("#model-name")).to_have_text(re.compile(r"^SmolLM2"))
    page.click("#info-button")
    assert "gguf" in page.locator("#info-list").inner_text()
    page.keyboard.press("Escape")
    set_settings(page, temperature="0", max_tokens="24")
    send(page, "What is the capital of France?")
    wait_idle(page)
    streamed = page.evaluate(STORED)[0]["messages"][1]["content"]
    # Oracle: the same greedy request through the official client, not streamed.
    client = openai.OpenAI(base_url=f"{api_url}/v1", api_key="unused", max_retries=0, timeout=60)
    reply = client.chat.completions.create(model=page.locator("#model-name").inner_text(), temperature=0, top_p=1,
                                           max_tokens=24, messages=[{"role": "user",
                                                                     "content": "What is the capital of France?"}])
    assert streamed == reply.choices[0].message.content and streamed.strip()
    assert page.locator(".message.assistant .content").inner_text().strip()
    assert page.errors == []
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
