"""A real redis-server for tests, demos and benchmarks: started on a free loopback port with
persistence off, stopped by pid (the tests' ``servers`` fixture lives in tests/conftest.py)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis

from .ports import free_port

REDIS = shutil.which("redis-server") or "redis-server"



class Server:
    """One redis-server process on a loopback port (or only a Unix socket / a TLS port)."""

    def __init__(self, folder: Path, *args: str, port: int | None = None) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.port = free_port("--cluster-enabled" in args) if port is None else port
        self.args = ["--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(folder), *args]
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        port = "0" if "--tls-port" in self.args or "--unixsocket" in self.args else str(self.port)
        log = open(self.folder / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen([REDIS, "--port", port, *self.args], stdout=log, stderr=log)
        log.close()

    def wait(self, client: Callable[[], redis.Redis]) -> None:
        deadline = time.monotonic() + 10
        while True:
            assert self.proc is not None and self.proc.poll() is None, (self.folder / "redis.log").read_text()
            try:
                if client().ping():
                    return
            except (redis.ConnectionError, redis.ResponseError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start: " + (self.folder / "redis.log").read_text())
            time.sleep(0.02)

    def client(self, **kw: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5, **kw)

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        pid = self.proc.pid
        os.kill(pid, signal.SIGCONT)
        os.kill(pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self.proc.wait(5)


def secret_file(folder: Path, name: str = "remote.secret") -> Path:
    """A fresh deployment secret for the remote tier in ``folder`` (as ``lmctl remote
    secret`` writes one: 32 random bytes, hex, mode 0600)."""
    path = folder / name
    path.write_text(os.urandom(32).hex() + "\n")
    path.chmod(0o600)
    return path
