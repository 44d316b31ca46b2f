"""What the reliability suite's scenarios share: deterministic chunk keys and payloads (its
workers use them too) and the tally each scenario returns."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


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
