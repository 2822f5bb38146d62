"""The UI test stack: the real API server and the UI server in one trio loop on a thread (as ``--ui-server``
wires them), in front of a scripted engine, plus a real headless Chromium driven by Playwright."""

from __future__ import annotations

import copy
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from candle_vllm.api.binds import Bind
from candle_vllm.api.server import serve
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from candle_vllm.pyengine.tokenizer import IncrementalDetokenizer, Tokenizer
from candle_vllm.ui.server import serve_ui, url_port
from tests.api.conftest import ServerThread, engine_cm, smol_tokenizer  # noqa: F401  (fixture re-export)
from tests.api.fake_engine import FakeEngine
from tests.api.mcp.conftest import stdio_spec

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
THINK_HINT = "reasoning goes in <think></think>"
ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts"
# A reply exercising what the page must render: reasoning, a heading, emphasis, a list, a table, code.
MARKDOWN_REPLY = (
    "<think>The user wants a greeting function.</think>\n\n"
    "# Greeting\n\nHere is **bold** advice:\n\n- first\n- second\n\n"
    "| lang | file |\n|---|---|\n| python | hello.py |\n\n"
    "```python\ndef greet(name):\n    return f\"Hello, {name}!\"\n```\n\nDone."
)


@dataclass
class SeenRequest:
    """What one generate() call received, for checking that the page's settings reached the engine."""

    request_id: str
    prompt: str
    params: Any


class ScriptedEngine(FakeEngine):
    """Streams ``script`` (tokenized with the real tokenizer) one token per ``delay_s``: the whole script then
    ``finish_reason="stop"``, or with ``repeat`` the script over and over until ``max_tokens`` (``"length"``)."""

    def __init__(self, tokenizer: Tokenizer, script: str = MARKDOWN_REPLY, *, delay_s: float = 0.01,
                 repeat: bool = False) -> None:
        super().__init__(tokenizer, delay_s=delay_s, max_model_len=4096)
        self.script_ids = tokenizer.encode(script, add_special_tokens=False)
        self.repeat = repeat
        self.requests: list[SeenRequest] = []

    async def generate(self, prompt_token_ids: list[int], params: Any, request_id: str,
                       prompt: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        self.requests.append(SeenRequest(request_id, prompt or "", params))
        self.running.add(request_id)
        count = params.max_tokens if self.repeat else len(self.script_ids)
        choice = CompletionOutput(index=0)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        metrics = RequestMetrics()
        try:
            for step in range(count):
                await trio.sleep(self.delay_s)
                if request_id not in self.running:
                    return
                token = self.script_ids[step % len(self.script_ids)]
                choice.text_delta = detok.push(token)
                choice.text += choice.text_delta
                choice.token_ids_delta = [token]
                choice.token_ids.append(token)
                done = step == count - 1
                if done:
                    choice.finish_reason = "length" if self.repeat else "stop"
                yield RequestOutput(request_id, prompt, list(prompt_token_ids), [_snapshot(choice)], finished=done,
                                    num_cached_tokens=0, prompt_logprobs=None, metrics=metrics)
        finally:
            self.running.discard(request_id)


def _snapshot(c: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(c.index, c.text, list(c.token_ids), None, c.finish_reason, c.stop_reason, c.text_delta,
                            list(c.token_ids_delta), None)


class UIStack(ServerThread):
    """``ServerThread`` that also serves the UI, both stopping on the same trigger as in ``api.server``."""

    ui_urls: list[str]

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self._engine_cm() as engine, trio.open_nursery() as nursery:
            self.engine = engine
            self.urls = await nursery.start(partial(serve, engine, self.config, self.binds,
                                                    shutdown_trigger=self._stop.wait))
            host = self.binds[0].address.rsplit(":", 1)[0]  # the UI on the API's host, as --ui-server does
            self.ui_urls = await nursery.start(partial(serve_ui, engine, self.config, url_port(self.urls[0]),
                                                       Bind("tcp", f"{host}:0"), shutdown_trigger=self._stop.wait))
            self._ready.set()

    @property
    def ui_url(self) -> str:
        return self.ui_urls[0] + "/"


@pytest.fixture
def ui_stack(request: pytest.FixtureRequest, smol_tokenizer: Tokenizer, tmp_path: Path) -> Iterator[UIStack]:  # noqa: F811
    """A running stack; parametrize indirectly with a dict of ScriptedEngine keywords (+ ``api_key``;
    ``think_template``: a chat template that names ``</think>``, so the API splits reasoning itself; ``mcp``:
    the MCP demo server (official SDK, stdio) as server ``local``, whose tools the API offers to the page's
    requests, with the ``qwen`` parser reading calls out of the script; ``ipv6``: both served on [::1])."""
    options = dict(getattr(request, "param", {}))
    api_key = options.pop("api_key", None)
    host = "[::1]" if options.pop("ipv6", False) else "127.0.0.1"
    mcp = [stdio_spec("local", tmp_path / "mcp.pid")] if options.pop("mcp", False) else []
    tokenizer = smol_tokenizer
    if options.pop("think_template", False):  # the server then finds <think> markers and splits the reply
        tokenizer = copy.copy(smol_tokenizer)
        tokenizer.chat_templates = {"default": f"{smol_tokenizer.chat_template}{{#- {THINK_HINT} -#}}"}
        tokenizer.chat_template = tokenizer.chat_templates["default"]
    engine = ScriptedEngine(tokenizer, **options)
    config = ServerConfig(api_key=api_key, mcp_servers=mcp, enforce_parser="qwen" if mcp else None)
    stack = UIStack(engine_cm(engine), config, [Bind("tcp", f"{host}:0")]).start()
    try:
        yield stack
    finally:
        stack.stop()


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    """Debian's Chromium, headless, through Playwright (never a downloaded browser)."""
    if not CHROMIUM.exists():
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium (see .ci/run)")
        pytest.skip("needs Debian's chromium: apt-get install -y chromium")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A fresh browser context (empty localStorage) whose console errors fail the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 800})
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
    page.set_default_timeout(20_000)
    page.errors = errors
    try:
        yield page
    finally:
        context.close()


def screenshot(page: Any, name: str) -> Path:
    """Write a screenshot under test-artifacts/ (git-ignored) and return its path."""
    ARTIFACTS.mkdir(exist_ok=True)
    path = ARTIFACTS / name
    page.screenshot(path=str(path), full_page=True)
    return path


def wait_until(predicate: Any, timeout_s: float = 10.0) -> None:
    """Poll a thread-safe condition (e.g. on the scripted engine) until it holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        time.sleep(0.02)
