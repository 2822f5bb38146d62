"""``--ui-server``: serve the chat page on the API port minus one, in the engine's nursery, beside the API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import trio
from hypercorn.trio import serve as hypercorn_serve

from candle_vllm.api.binds import Bind
from candle_vllm.api.server import hypercorn_config
from candle_vllm.api.state import ServerConfig
from candle_vllm.ui.app import create_ui_app


def ui_bind_for(api: Bind) -> Bind:
    """The UI's address: the API's host on the API port minus one (port 0, any free port, stays 0)."""
    if api.kind != "tcp":
        raise ValueError("--ui-server needs a TCP API address (the UI listens on the API port minus one); "
                         "use --h host:port instead of a unix socket, or drop --ui-server")
    host, _, port_text = api.address.rpartition(":")
    port = int(port_text)
    if port == 1:
        raise ValueError("--ui-server needs an API port of at least 2 (the UI listens on the API port minus one)")
    return Bind("tcp", f"{host}:{max(port - 1, 0)}")


def url_port(url: str) -> int:
    """The TCP port of a URL hypercorn reports, e.g. ``http://127.0.0.1:2000``."""
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"{url!r} names no port")
    return port


async def serve_ui(
    engine: Any,
    config: ServerConfig,
    api_port: int,
    bind: Bind,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the UI for the API on ``api_port`` until ``shutdown_trigger`` returns.

    Records the UI's real port in ``config.ui_port`` (the API then answers the page's cross-origin calls)
    before ``task_status.started`` receives the UI's URLs.
    """
    app = create_ui_app(engine, api_port, api_key_required=config.api_key is not None)
    async with trio.open_nursery() as nursery:
        urls = await nursery.start(partial(hypercorn_serve, app, hypercorn_config([bind]),
                                           shutdown_trigger=shutdown_trigger))
        config.ui_port = url_port(urls[0])
        task_status.started(urls)
