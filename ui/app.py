"""The UI server's quart-trio app: the chat page (static HTML/CSS/JS written for this project), its settings
(``/config.json``: where the API is, facts about the model) and ``/render`` (markdown to safe HTML).

It proxies nothing: the page calls the API port itself (see ``candle_vllm.ui.cors``), so streaming, stop
(an aborted fetch is a client disconnect, which aborts the engine request) and ``--api-key`` behave exactly
as for any other API client.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from quart import Response, jsonify, request
from quart_trio import QuartTrio

from candle_vllm.ui.render import code_css, render_markdown

STATIC_DIR = Path(__file__).parent / "static"
MAX_RENDER_BYTES = 4 * 1024 * 1024


def content_security_policy(api_port: int) -> str:
    """Only this server's own scripts and styles run; the page may connect to itself and the API port."""
    return "; ".join([
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: http: https:",
        f"connect-src 'self' http://*:{api_port} https://*:{api_port}",
        "object-src 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ])


def engine_facts(engine: Any) -> dict[str, Any]:
    """What the page's model-info panel shows (the engine's load summary when it has one)."""
    facts: dict[str, Any] = {"model": engine.model_name, "max_model_len": engine.max_model_len}
    info = getattr(engine, "info", None)
    if info is not None:
        facts.update(device=str(info.device), dtype=str(info.dtype).removeprefix("torch."),
                     quantization=info.quantization, kv_cache_tokens=info.kv_capacity_tokens)
    return facts


def create_ui_app(engine: Any, api_port: int, api_key_required: bool) -> QuartTrio:
    """The UI app for ``engine``'s API listening on ``api_port`` (same host as the page)."""
    app = QuartTrio(__name__, static_folder=str(STATIC_DIR), static_url_path="/static")
    app.config.update(MAX_CONTENT_LENGTH=MAX_RENDER_BYTES, SEND_FILE_MAX_AGE_DEFAULT=0)
    csp = content_security_policy(api_port)
    css = code_css()
    config = {"api_port": api_port, "api_key_required": api_key_required, "engine": engine_facts(engine)}

    @app.get("/")
    async def index() -> Response:
        response = await app.send_static_file("index.html")
        response.headers["Content-Security-Policy"] = csp
        return response

    @app.get("/code.css")
    async def code_stylesheet() -> Response:
        return Response(css, content_type="text/css; charset=utf-8")

    @app.get("/config.json")
    async def page_config() -> Response:
        return jsonify(config)

    @app.post("/render")
    async def render() -> Any:
        body = await request.get_json(force=True, silent=True)
        texts = body.get("texts") if isinstance(body, dict) else None
        if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
            return jsonify({"error": 'send JSON {"texts": [markdown, ...]}'}), 400
        return jsonify({"html": [render_markdown(t) for t in texts]})

    return app
