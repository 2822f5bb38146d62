"""The UI server over HTTP: page, config, render endpoint, and the API's CORS answers to the UI's origin."""

from __future__ import annotations

import httpx2
import pytest

from candle_vllm.api import cli
from candle_vllm.ui.server import url_port
from tests.ui.conftest import UIStack


def ui_client(stack: UIStack) -> httpx2.Client:
    return httpx2.Client(base_url=stack.ui_urls[0], timeout=30)


def test_page_config_and_static_files(ui_stack: UIStack) -> None:
    api_port = url_port(ui_stack.urls[0])
    with ui_client(ui_stack) as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and f"http://*:{api_port}" in csp
        assert all(path in page.text for path in ("/static/app.js", "/static/style.css", "/code.css"))
        for path in ("/static/app.js", "/static/stream.js", "/static/markdown.js", "/static/tool_calls.js",
                     "/static/style.css", "/code.css"):
            assert http.get(path).status_code == 200, path
        config = http.get("/config.json").json()
    assert config == {"api_port": api_port, "api_key_required": False,
                      "engine": {"model": "fake-model", "max_model_len": 4096}}


def test_render_endpoint_checks_its_body(ui_stack: UIStack) -> None:
    with ui_client(ui_stack) as http:
        ok = http.post("/render", json={"texts": ["# a", "<b>x</b>"]})
        assert ok.json() == {"html": ["<h1>a</h1>\n", "<p>&lt;b&gt;x&lt;/b&gt;</p>\n"]}
        for bad in ({"texts": "# a"}, {"texts": [1]}, ["# a"], {}):
            response = http.post("/render", json=bad)
            assert response.status_code == 400 and "texts" in response.json()["error"]
        assert http.post("/render", content=b"x" * (5 * 1024 * 1024)).status_code == 413


@pytest.mark.parametrize("ui_stack", [{"api_key": "sekret"}], indirect=True)
def test_api_answers_cors_only_for_the_ui_origin(ui_stack: UIStack) -> None:
    ui_origin = f"http://127.0.0.1:{ui_stack.config.ui_port}"
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    with ui_stack.http() as api:
        allowed = api.options("/v1/chat/completions", headers={"Origin": ui_origin, **preflight})
        assert allowed.status_code == 200  # a preflight needs no key, though the server has one
        assert allowed.headers["access-control-allow-origin"] == ui_origin
        assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
        denied = api.options("/v1/chat/completions", headers={"Origin": "http://evil.example:1", **preflight})
        assert "access-control-allow-origin" not in denied.headers
        models = api.get("/v1/models", headers={"Origin": ui_origin, "Authorization": "Bearer sekret"})
        assert models.status_code == 200 and models.headers["access-control-allow-origin"] == ui_origin
        refused = api.get("/v1/models", headers={"Origin": ui_origin})  # the key is still required
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == ui_origin
    with ui_client(ui_stack) as http:
        assert http.get("/config.json").json()["api_key_required"] is True


@pytest.mark.parametrize(("argv", "says"), [(["--h", "unix:///tmp/candle-ui-test.sock"], "needs a TCP API address"),
                                            (["--p", "1"], "API port of at least 2")])
def test_ui_server_refuses_api_addresses_it_cannot_follow(argv: list[str], says: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--cpu", "--ui-server", *argv]) == 2  # refused before the model loads
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("candle-vllm: --ui-server") and says in err
