"""Serve the app with hypercorn's trio worker in the engine's nursery, and shut down on SIGINT/SIGTERM by
draining: new requests get 503, in-flight ones get ``shutdown_timeout_s`` to finish, the rest end with
``finish_reason: "abort"`` and ``[DONE]``, then the listeners close; the whole sequence stays under 5 s."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.trio import serve as hypercorn_serve

from candle_vllm import __version__
from candle_vllm.api.app import create_app
from candle_vllm.api.binds import Bind, check_listenable, parse_bind
from candle_vllm.api.state import ServerConfig, ServerState

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup  # trio's dependency on 3.10

log = logging.getLogger(__name__)

ABORT_GRACE_S = 1.0  # after aborting, how long streams get to write their last chunks
HTTP_GRACE_S = 1.0  # hypercorn's wait for open connections once the listeners are closed


def hypercorn_config(binds: list[Bind]) -> HypercornConfig:
    cfg = HypercornConfig()
    cfg.bind = [b.hypercorn for b in binds]
    cfg.graceful_timeout = HTTP_GRACE_S
    cfg.accesslog = None
    cfg.keep_alive_timeout = 30
    if any(b.kind == "unix" for b in binds):
        cfg.umask = 0o177  # the socket file is created 0600: only this user may talk to the server
    return cfg


async def drain(state: ServerState, timeout_s: float) -> None:
    """Refuse new requests, let in-flight ones finish for ``timeout_s``, then abort what is left."""
    state.draining = True
    log.info("draining: %d request(s) in flight, %.1f s to finish", state.num_active, timeout_s)
    with trio.move_on_after(timeout_s):
        await state.wait_idle()
    if state.num_active:
        log.info("aborting %d request(s) still running", state.num_active)
        state.abort_all()
        with trio.move_on_after(ABORT_GRACE_S):
            await state.wait_idle()


async def wait_for_signal() -> None:
    """Return at the first SIGINT or SIGTERM."""
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            return


async def serve(
    engine: Any,
    config: ServerConfig,
    binds: list[Bind],
    *,
    shutdown_trigger: Callable[[], Awaitable[None]] = wait_for_signal,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve ``engine`` on ``binds`` until ``shutdown_trigger`` returns, then drain and stop.

    ``task_status.started`` receives the real URLs (port 0 resolved), so callers can print or test them.
    """
    state = ServerState(engine, config)
    app = create_app(state)
    stop = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            state.nursery = nursery
            if state.mcp is not None:  # first tool listings done (or failed) before the first request
                await nursery.start(state.mcp.run)
            urls = await nursery.start(partial(hypercorn_serve, app, hypercorn_config(binds),
                                               shutdown_trigger=stop.wait))
            task_status.started(urls)
            await shutdown_trigger()
            if state.mcp is not None:  # MCP servers shut down while the requests drain
                state.mcp.stop()
            await drain(state, config.shutdown_timeout_s)
            stop.set()
            # hypercorn closes its connections within HTTP_GRACE_S; nothing may outlive that by much
            nursery.cancel_scope.deadline = trio.current_time() + HTTP_GRACE_S + 0.5
    finally:
        for b in binds:
            if b.kind == "unix":
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(b.address)


def startup_summary(engine: Any, urls: list[str], ui_urls: Sequence[str] = ()) -> str:
    """What was loaded and where it listens (printed once the sockets are bound, port 0 resolved)."""
    info = engine.info
    lines = [
        f"candle-vllm {__version__} serving {engine.model_name}",
        f"  device {info.device}, dtype {str(info.dtype).removeprefix('torch.')}, quantization {info.quantization}, "
        f"max_model_len {info.max_model_len}",
        f"  KV cache: {info.kv_capacity_tokens} tokens ({info.num_blocks} blocks x {info.block_size}, "
        f"{info.kv_cache_label})",
    ]
    lines += [f"  API: {url}/v1 (OpenAI-compatible; /health, /metrics, /openapi.json)" for url in urls]
    lines += [f"  UI: {url}/ (web chat)" for url in ui_urls]
    return "\n".join(lines)


async def _serve_engine(engine_args: Any, config: ServerConfig, binds: list[Bind], ui_bind: Bind | None) -> None:
    from candle_vllm.actors.engine import open_engine
    from candle_vllm.ui.server import serve_ui, url_port

    async with open_engine(engine_args) as engine, trio.open_nursery() as nursery:
        stop = trio.Event()  # set at the signal: the UI closes while the API drains

        async def shutdown_trigger() -> None:
            await wait_for_signal()
            stop.set()

        urls = await nursery.start(partial(serve, engine, config, binds, shutdown_trigger=shutdown_trigger))
        ui_urls = [] if ui_bind is None else await nursery.start(
            partial(serve_ui, engine, config, url_port(urls[0]), ui_bind, shutdown_trigger=stop.wait))
        print(startup_summary(engine, urls, ui_urls), flush=True)


def listen_failure(error: OSError, binds: Sequence[Bind]) -> str:
    """The one line for addresses that cannot be listened on."""
    return f"cannot listen on {', '.join(b.hypercorn for b in binds)}: {error.strerror or error}"


def startup_failure(error: BaseException, binds: Sequence[Bind]) -> tuple[int, str] | None:
    """(exit code, one line) for an error that ends the server before it serves, so the CLI prints that line
    instead of a traceback: a model that cannot load (1), flag values the loaded model cannot take or an address
    that cannot be listened on (2), Ctrl-C (130). None for anything else (a bug: its traceback is kept). The
    error may come wrapped in (nested) exception groups from the nurseries."""
    from candle_vllm.pyengine.engine_args import EngineConfigError
    from candle_vllm.pyengine.loader.errors import ModelLoadError

    if isinstance(error, BaseExceptionGroup):
        found = (startup_failure(e, binds) for e in error.exceptions)
        return next((f for f in found if f is not None), None)
    if isinstance(error, ModelLoadError):
        return 1, str(error)
    if isinstance(error, EngineConfigError):
        return 2, str(error)
    if isinstance(error, OSError):
        return 2, listen_failure(error, binds)
    if isinstance(error, KeyboardInterrupt):
        return 130, "interrupted"
    return None


def run(engine_args: Any, server_args: Any) -> int:
    """The CLI's server: load the model, serve until SIGINT/SIGTERM, drain, exit 0 (see :func:`startup_failure`
    for the codes of a server that could not start)."""
    from candle_vllm.ui.server import ui_bind_for

    try:
        bind = parse_bind(server_args.host, server_args.port)
        ui_bind = ui_bind_for(bind) if server_args.ui_server else None
    except ValueError as e:
        print(f"candle-vllm: {e}", file=sys.stderr)
        return 2
    binds = [bind] if ui_bind is None else [bind, ui_bind]
    try:
        for b in binds:
            check_listenable(b)
    except OSError as e:
        print(f"candle-vllm: {listen_failure(e, binds)}", file=sys.stderr)  # before the model loads
        return 2
    config = ServerConfig(api_key=server_args.api_key, enforce_parser=server_args.enforce_parser,
                          mcp_servers=server_args.mcp_servers,
                          mcp_refresh_s=server_args.mcp_refresh_s,
                          trust_request_chat_template=server_args.trust_request_chat_template,
                          return_tokens_as_token_ids=server_args.return_tokens_as_token_ids)
    try:
        trio.run(_serve_engine, engine_args, config, [bind], ui_bind)
    except BaseException as e:
        failure = startup_failure(e, binds)
        if failure is None:
            raise
        print(f"candle-vllm: {failure[1]}", file=sys.stderr)
        return failure[0]
    return 0
