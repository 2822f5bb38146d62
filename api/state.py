"""What every route needs: the engine, the server's settings, its metrics and its in-flight requests.

Tracking in-flight requests here is what lets a drain (SIGTERM) wait for them, then end the stragglers with
``finish_reason: "abort"``, and lets overload be answered with 503 before the engine queue grows unbounded.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import trio

from candle_vllm.api.limits import TokenLimits
from candle_vllm.api.logprobs import ChatLogprobs
from candle_vllm.api.mcp.config import DEFAULT_REFRESH_S, McpServerSpec
from candle_vllm.api.metrics import ServerMetrics
from candle_vllm.api.reasoning import ThinkMarkers, think_markers
from candle_vllm.api.tool_parsers import default_parser_name

if TYPE_CHECKING:
    from candle_vllm.api.mcp.manager import McpManager


class InFlight(Protocol):
    """What the server tracks as one request in flight (a batch of engine requests, or a whole beam search):
    a drain waits for it, then ends it with ``abort``."""

    def abort(self) -> None: ...


@dataclass(slots=True)
class ServerConfig:
    """HTTP-layer settings (from the CLI's server flags)."""

    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)  # empty: the engine's model name
    keepalive_s: float = 10.0  # ": ping" comment after this many idle seconds in a stream
    shutdown_timeout_s: float = 2.0  # on SIGTERM, in-flight requests get this long before being aborted
    max_pending_requests: int = 4096  # beyond this many in-flight requests, answer 503
    max_body_bytes: int = 16 * 1024 * 1024
    ui_port: int | None = None  # the web UI's port (--ui-server): its page may call the API cross-origin
    enforce_parser: str | None = None  # --enforce-parser: the tool-call parser instead of the model family's
    mcp_servers: list[McpServerSpec] = field(default_factory=list)  # --mcp-config / --mcp-command
    mcp_refresh_s: float = DEFAULT_REFRESH_S  # --mcp-refresh-s
    trust_request_chat_template: bool = False  # --trust-request-chat-template: requests may bring a template
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: logprobs name tokens "token_id:N"


# Worker threads preparing prompts (template render, tokenize) at once; more requests wait for a free one.
# Tokenizing releases the GIL and uses one core per thread; rendering holds the GIL, so more threads would
# not render faster and would only take more of the event loop's share.
PROMPT_THREADS = max(2, min(8, os.cpu_count() or 2))


class ServerState:
    """Shared by the routes of one app; ``nursery`` hosts the background pumps of engine requests.

    The model's think markers, tool-call parser, token limits and token bytes are found once here, at start-up."""

    def __init__(self, engine: Any, config: ServerConfig, nursery: trio.Nursery | None = None) -> None:
        self.engine = engine
        self.config = config
        self.model_names = config.served_model_names or [engine.model_name]
        self.metrics = ServerMetrics(self.model_names[0], engine.max_model_len)
        self.created = int(time.time())
        self.think_markers: ThinkMarkers | None = think_markers(engine.tokenizer)
        self.token_limits = TokenLimits.of(engine)
        self.chat_logprobs = ChatLogprobs(engine.tokenizer)
        model_config = getattr(engine, "model_config", None)
        self.tool_parser: str | None = config.enforce_parser or default_parser_name(
            getattr(model_config, "architecture", ""), engine.model_name, engine.tokenizer.chat_template)
        self._nursery = nursery
        self.prompt_limiter = trio.CapacityLimiter(PROMPT_THREADS)
        self.draining = False
        self._active: set[InFlight] = set()
        self._idle = trio.Event()
        self._idle.set()
        self.mcp: McpManager | None = None
        if config.mcp_servers:  # imported only when used: the mcp SDK takes about a second to import
            from candle_vllm.api.mcp.manager import McpManager

            self.mcp = McpManager(config.mcp_servers, config.mcp_refresh_s)

    def mcp_tools(self) -> list[dict[str, Any]] | None:
        """The MCP servers' tools (``ID_TOOLNAME``), offered to chat requests that bring none; None without MCP."""
        return self.mcp.tools() if self.mcp is not None else None

    @property
    def nursery(self) -> trio.Nursery:
        if self._nursery is None:
            raise RuntimeError("ServerState.nursery is not set: serve the app through candle_vllm.api.server")
        return self._nursery

    @nursery.setter
    def nursery(self, value: trio.Nursery) -> None:
        self._nursery = value

    @property
    def num_active(self) -> int:
        return len(self._active)

    def track(self, gen: InFlight) -> None:
        self._active.add(gen)
        self._idle = trio.Event() if self._idle.is_set() else self._idle

    def forget(self, gen: InFlight) -> None:
        self._active.discard(gen)
        if not self._active:
            self._idle.set()

    async def wait_idle(self) -> None:
        """Return once no engine request started by this server is in flight."""
        while self._active:
            await self._idle.wait()

    def abort_all(self) -> None:
        """End every in-flight request now; their handlers finish them with ``finish_reason: "abort"``."""
        for gen in list(self._active):
            gen.abort()
