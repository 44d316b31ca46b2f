"""Deterministic chunk keys and payloads shared by the reliability suite and its workers."""

from __future__ import annotations

import hashlib


def key(i: int) -> bytes:
    return b"\x02" * 16 + hashlib.sha256(i.to_bytes(8, "big")).digest()


def content(k: bytes, n: int) -> bytes:
    """A payload unique to its key and position, so any process can check what it reads."""
    block = hashlib.shake_256(k).digest(4096)
    out = bytearray((block * (n // len(block) + 1))[:n])
    for pos in range(0, n, 4096):
        out[pos : pos + 8] = pos.to_bytes(8, "little")
    return bytes(out)
