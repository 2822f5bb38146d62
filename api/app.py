"""The quart-trio application factory: routes, API-key check, limits, and OpenAI-shaped error handlers."""

from __future__ import annotations

import contextlib
import hmac
import logging
from typing import Any

import trio
from quart import Response, jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from candle_vllm.api.errors import APIError, error_body
from candle_vllm.api.routes import chat, completions, embeddings, invocations, misc, responses
from candle_vllm.api.routes.common import STATE_KEY
from candle_vllm.api.state import ServerState
from candle_vllm.ui.cors import cors_headers, is_ui_origin

log = logging.getLogger(__name__)

# Operational endpoints stay open when --api-key is set (probes and scrapers carry no key), as in vLLM.
PUBLIC_PATHS = frozenset({"/health", "/ping", "/load", "/version", "/metrics", "/openapi.json"})
HARD_BODY_FACTOR = 8  # bodies over this many times the body limit are cut off unread
BODY_DRAIN_TIMEOUT_S = 10.0


def _error_response(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    response = jsonify(body)
    response.status_code = status
    response.headers.update(headers or {})
    return response


async def _finish_reading_body() -> None:
    """Read whatever is left of the request body before an error answer goes out.

    An answer sent mid-upload makes hypercorn close the connection with unread bytes; the reset can swallow the
    answer, and a client reusing the pooled connection hangs until its timeout (seen under load). Bodies over
    quart's hard cap stay unread: that connection is closed on purpose.
    """
    with contextlib.suppress(HTTPException), trio.move_on_after(BODY_DRAIN_TIMEOUT_S):
        await request.get_data()


def create_app(state: ServerState) -> QuartTrio:
    """A new app bound to ``state`` (its engine, settings, metrics); serve it with ``api.server``."""
    app = QuartTrio("candle_vllm.api")
    app.extensions[STATE_KEY] = state
    app.config.update(
        RESPONSE_TIMEOUT=None,  # streams may run for minutes; quart's 60 s default cuts them silently
        BODY_TIMEOUT=60,
        # quart's own limit answers 413 before the body is read (see read_json for why that hurts), so it only
        # stops absurd bodies; read_json() reads the body before refusing one over max_body_bytes.
        MAX_CONTENT_LENGTH=HARD_BODY_FACTOR * state.config.max_body_bytes,
        JSON_SORT_KEYS=False,
    )
    app.json.sort_keys = False  # type: ignore[attr-defined]  # Quart's DefaultJSONProvider
    app.json.ensure_ascii = False  # type: ignore[attr-defined]
    for bp in (chat.bp, completions.bp, embeddings.bp, invocations.bp, misc.bp, responses.bp):
        app.register_blueprint(bp)

    @app.before_request
    async def _authenticate() -> None:
        key = state.config.api_key
        # CORS preflights (OPTIONS) never carry the key; they only ask what the page may send
        if key is None or request.path in PUBLIC_PATHS or request.method == "OPTIONS":
            return
        given = request.headers.get("Authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>' (see --api-key)",
                           code="invalid_api_key")

    @app.after_request
    async def _cors(response: Response) -> Response:
        origin = request.headers.get("Origin")
        if origin and is_ui_origin(origin, request.host, state.config.ui_port):
            response.headers.update(cors_headers(origin, preflight=request.method == "OPTIONS"))
        return response

    @app.errorhandler(APIError)
    async def _api_error(exc: APIError) -> Response:
        await _finish_reading_body()
        return _error_response(exc.status, exc.body(), exc.headers)

    @app.errorhandler(HTTPException)
    async def _http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        message = exc.description or exc.name
        if status == 404:
            message = f"{request.method} {request.path} is not an endpoint of this server; see /openapi.json"
        elif status == 413:
            message = f"the request body is larger than {state.config.max_body_bytes} bytes"
        await _finish_reading_body()
        return _error_response(status, error_body(status, message))

    @app.errorhandler(Exception)
    async def _unexpected(exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return _error_response(500, error_body(500, f"internal error: {type(exc).__name__}: {exc}"))

    return app
