"""The tests' redis-server: testsupport/redis.py (shared with the demos and benchmarks), under
the name the tests import it by; and ``as_bytes``, for the values the tests' clients read."""

from testsupport.ports import free_port
from testsupport.redis import REDIS, Server, secret_file

__all__ = ["REDIS", "Server", "as_bytes", "free_port", "secret_file"]


def as_bytes(v: bytes | str) -> bytes:
    """A key or value as redis-py returns it (typed ``bytes | str``): the tests' clients do not
    decode responses, so it must be bytes."""
    assert isinstance(v, bytes), f"a decoded response: {v!r}"
    return v
