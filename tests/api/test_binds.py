"""``--h``/``--p`` parsing against the forms the Rust CLI documents, and the error for each malformed one."""

from __future__ import annotations

import pytest

from candle_vllm.api.binds import Bind, parse_bind


@pytest.mark.parametrize(
    ("host", "port", "want"),
    [
        ("0.0.0.0", 2000, Bind("tcp", "0.0.0.0:2000")),
        ("127.0.0.1:8000", 2000, Bind("tcp", "127.0.0.1:8000")),
        ("localhost", 0, Bind("tcp", "localhost:0")),
        ("[::1]:8000", 2000, Bind("tcp", "[::1]:8000")),
        ("[::1]", 9000, Bind("tcp", "[::1]:9000")),
        ("::", 9000, Bind("tcp", "[::]:9000")),
        ("tcp://127.0.0.1", 7000, Bind("tcp", "127.0.0.1:7000")),
        ("tcp://127.0.0.1:7001", 7000, Bind("tcp", "127.0.0.1:7001")),
        ("tcp://[::1]:7002/", 7000, Bind("tcp", "[::1]:7002")),
        ("unix:///tmp/a.sock", 2000, Bind("unix", "/tmp/a.sock")),
        ("file:///tmp/b.sock", 2000, Bind("unix", "/tmp/b.sock")),
        ("socket:///tmp/c.sock", 2000, Bind("unix", "/tmp/c.sock")),
        ("unix:/tmp/d.sock", 2000, Bind("unix", "/tmp/d.sock")),
    ],
)
def test_bind_forms(host: str, port: int, want: Bind) -> None:
    assert parse_bind(host, port) == want


def test_hypercorn_strings() -> None:
    assert parse_bind("unix:///tmp/x.sock", 1).hypercorn == "unix:/tmp/x.sock"
    assert parse_bind("[::1]:5", 1).hypercorn == "[::1]:5"


@pytest.mark.parametrize(
    ("host", "port", "message"),
    [
        ("", 2000, "must not be empty"),
        ("127.0.0.1:99999", 2000, "port must be a number"),
        ("127.0.0.1:http", 2000, "port must be a number"),
        ("[::1:80", 2000, "missing ']'"),
        ("[::1]x", 2000, "expected ':port'"),
        ("http://127.0.0.1", 2000, "unsupported scheme"),
        ("unix://relative.sock", 2000, "must be absolute"),
        (":80", 2000, "missing host"),
        ("127.0.0.1", 70000, "--p must be in"),
    ],
)
def test_bad_binds_say_what_is_wrong(host: str, port: int, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_bind(host, port)
