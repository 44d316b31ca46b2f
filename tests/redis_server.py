"""The tests' redis-server: testsupport/redis.py (shared with the demos and benchmarks), under
the name the tests import it by."""

from testsupport.ports import free_port
from testsupport.redis import REDIS, Server, secret_file

__all__ = ["REDIS", "Server", "free_port", "secret_file"]
