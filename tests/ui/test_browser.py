"""The chat page in a real headless Chromium: streamed markdown, reasoning, settings, copy, stop, regenerate,
conversations kept across reloads; and ``candle-vllm --ui-server`` serving it with the real model."""

from __future__ import annotations

import json
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


@pytest.mark.parametrize("ui_stack", [{"delay_s": 0.02, "repeat": True}], indirect=True)
def test_stop_aborts_the_generation_and_regenerate_asks_again(ui_stack: UIStack, page: Any) -> None:
    engine = ui_stack.engine
    page.goto(ui_stack.ui_url)
    expect(page.locator("#model-name")).to_have_text("fake-model")
    set_settings(page, max_tokens="3000")
    send(page, "Tell me everything")
    page.wait_for_selector(".message.assistant .content h1")  # partway through the stream
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


def sse(*chunks: dict[str, Any]) -> str:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + ": ping\n\ndata: [DONE]\n\n"


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": "stop" if not fields else None}]}


def test_reasoning_deltas_thinking_switch_and_api_errors(ui_stack: UIStack, page: Any) -> None:
    """The page against hand-written API answers: ``reasoning_content`` deltas, an error body."""
    bodies: list[dict[str, Any]] = []
    cors = {"Access-Control-Allow-Origin": "*"}

    def answer(route: Any) -> None:
        bodies.append(json.loads(route.request.post_data))
        if len(bodies) == 1:
            route.fulfill(status=200, headers={**cors, "Content-Type": "text/event-stream"},
                          body=sse(delta(role="assistant", reasoning_content="Step **one**."),
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
