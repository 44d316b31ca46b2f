"""What the reliability suite's scenarios share: deterministic chunk keys and payloads (its
workers use them too) and the tally each scenario returns."""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def key(i: int) -> bytes:
    return b"\x02" * 16 + hashlib.sha256(i.to_bytes(8, "big")).digest()


def content(k: bytes, n: int) -> bytes:
    """A payload unique to its key and position, so any process can check what it reads."""
    block = hashlib.shake_256(k).digest(4096)
    out = bytearray((block * (n // len(block) + 1))[:n])
    for pos in range(0, n, 4096):
        out[pos : pos + 8] = pos.to_bytes(8, "little")
    return bytes(out)


class Tally:
    def __init__(self, name: str) -> None:
        self.name = name
        self.trials = 0
        self.failures: list[str] = []
        self.facts: dict[str, Any] = {}

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)

    def row(self) -> dict[str, Any]:
        return {"scenario": self.name, "trials": self.trials, "failures": len(self.failures),
                "first_failures": self.failures[:5], **self.facts}


class Worker:
    """A script of the suite run as a process that takes commands on stdin, a line each, and
    prints lines; a thread collects them as they come (``on_line`` sees each one)."""

    def __init__(self, script: Path, *args: str, on_line: Callable[[str], None] | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.proc = subprocess.Popen([sys.executable, str(script), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self._seen = 0  # lines before this one were matched by wait_for already
        self._exited = False
        self._on_line = on_line
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.strip())
                if self._on_line is not None:
                    self._on_line(line)
                self._cv.notify_all()
        with self._cv:
            self._exited = True
            self._cv.notify_all()

    def send(self, *cmds: str) -> None:
        assert self.proc.stdin is not None
        for c in cmds:
            self.proc.stdin.write(c + "\n")
        self.proc.stdin.flush()

    def wait_for(self, prefix: str, timeout: float = 60.0) -> str | None:
        """The next line (after those matched before) that starts with ``prefix``; None when
        none came within ``timeout`` seconds. ``RuntimeError`` if the process exited first."""
        end = time.monotonic() + timeout
        with self._cv:
            while True:
                for i in range(self._seen, len(self.lines)):
                    if self.lines[i].startswith(prefix):
                        self._seen = i + 1
                        return self.lines[i]
                if self._exited:
                    err = self.proc.stderr.read() if self.proc.stderr else ""
                    raise RuntimeError(f"the worker exited before saying {prefix!r}: {self.lines[-3:]} {err[-600:]}")
                left = end - time.monotonic()
                if left <= 0:
                    return None
                self._cv.wait(min(left, 0.1))

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """``wait_for``, raising ``RuntimeError`` on a timeout."""
        line = self.wait_for(prefix, timeout)
        if line is None:
            raise RuntimeError(f"the worker did not say {prefix!r} within {timeout} s: {self.lines[-3:]}")
        return line

    def kill(self) -> float:
        """SIGKILL, and take in every line it printed; returns when (monotonic) it was killed."""
        at = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=10)
        return at
@contextmanager
def quiet_store_log(level: int = logging.CRITICAL) -> Iterator[None]:
    """The store's log below ``level`` is dropped meanwhile: a scenario that injects faults
    by the hundred would print a warning for each one it is checking."""
    log = logging.getLogger("lmctl.store")
    before = log.level
    log.setLevel(level)
    try:
        yield
    finally:
        log.setLevel(before)
