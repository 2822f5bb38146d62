"""``--h``/``--p`` to listening addresses: host, host:port, [ipv6]:port, bare IPv6, tcp://host[:port], and
unix sockets as unix:///path, file:///path or socket:///path (the forms the Rust CLI accepts)."""

from __future__ import annotations

import socket
from dataclasses import dataclass

UNIX_SCHEMES = ("unix://", "file://", "socket://")


@dataclass(frozen=True, slots=True)
class Bind:
    """One listening address; ``hypercorn`` is the string hypercorn's ``Config.bind`` takes."""

    kind: str  # "tcp" | "unix"
    address: str  # host:port ([v6]:port) or the socket path

    @property
    def hypercorn(self) -> str:
        return f"unix:{self.address}" if self.kind == "unix" else self.address


def _port(text: str, whole: str) -> int:
    if not text.isdigit() or not 0 <= int(text) <= 65535:
        raise ValueError(f"--h {whole!r}: port must be a number in [0, 65535], got {text!r}")
    return int(text)


def parse_bind(host: str, port: int) -> Bind:
    """The address ``--h host`` (with ``--p port`` when the host names none) stands for."""
    whole = host.strip()
    if not whole:
        raise ValueError("--h must not be empty; use e.g. 0.0.0.0, 127.0.0.1:8000 or unix:///tmp/candle.sock")
    if not 0 <= port <= 65535:
        raise ValueError(f"--p must be in [0, 65535], got {port}")
    for scheme in UNIX_SCHEMES:
        if whole.startswith(scheme):
            path = whole[len(scheme):]
            if not path.startswith("/"):
                raise ValueError(f"--h {whole!r}: a socket path must be absolute, e.g. {scheme}/tmp/candle.sock")
            return Bind("unix", path)
    if whole.startswith("unix:"):
        return parse_bind("unix://" + whole[len("unix:"):], port)
    rest = whole.removeprefix("tcp://").rstrip("/")
    if "://" in rest:
        raise ValueError(f"--h {whole!r}: unsupported scheme; use tcp://, unix://, file:// or socket://")
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0:
            raise ValueError(f"--h {whole!r}: missing ']' after the IPv6 address")
        addr, tail = rest[1:end], rest[end + 1:]
        if tail and not tail.startswith(":"):
            raise ValueError(f"--h {whole!r}: expected ':port' after ']'")
        p = _port(tail[1:], whole) if tail else port
        return Bind("tcp", f"[{addr}]:{p}")
    if rest.count(":") > 1:  # a bare IPv6 address
        return Bind("tcp", f"[{rest}]:{port}")
    name, sep, tail = rest.partition(":")
    if not name:
        raise ValueError(f"--h {whole!r}: missing host name")
    return Bind("tcp", f"{name}:{_port(tail, whole) if sep else port}")


def check_listenable(bind: Bind) -> None:
    """Raise OSError now when a TCP address cannot be listened on (a port in use, an address this host does not
    have), so the CLI says so before spending the model's load time; hypercorn binds for real later. Unix sockets
    are left to hypercorn (it replaces a stale socket file)."""
    if bind.kind != "tcp":
        return
    host, _, port = bind.address.rpartition(":")
    family, kind, proto, _, address = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as hypercorn: TIME_WAIT is no conflict
        probe.bind(address)
