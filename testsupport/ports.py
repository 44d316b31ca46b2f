"""The one free-port helper of the tests, demos and benchmarks."""

from __future__ import annotations

import socket


def free_port(also_bus: bool = False) -> int:
    """A free loopback port (and, for a Redis Cluster node, its bus port + 10000 free too)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not also_bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    continue
    raise RuntimeError("no free port pair")
