"""A free TCP port on loopback, for a server a test or a benchmark starts next (moto, a proxy, an engine)."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on loopback now (another process may take it before the server binds: tests only)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
