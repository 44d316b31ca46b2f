"""The wire protocol between ``lmctl`` and ``lmctl serve``: framed, versioned JSON.

A frame is a 4-byte header, ``b"LM"`` plus the protocol version (one byte) and a zero
byte, then a 4-byte big-endian body length, then the body: one UTF-8 JSON object.

* request: ``{"id": N, "cmd": "lookup", "args": {...}}``
* progress (any number, before the reply): ``{"id": N, "progress": {"done": d, "total": t, "what": "..."}}``
* reply: ``{"id": N, "ok": true, "result": {...}}`` or
  ``{"id": N, "ok": false, "error": {"code": "usage"|"failed"|"protocol", "message": "..."}}``

Bodies over ``MAX_FRAME`` bytes are refused: the daemon answers with an error and closes
the connection, since the rest of the stream cannot be trusted.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Any

VERSION = 1
MAGIC = b"LM"
MAX_FRAME = 8 << 20
_HEADER = struct.Struct(">2sBxI")


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (``SO_PEERCRED``:
    set by the kernel when it connected or bound, so the peer cannot forge it)."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame."""


class FrameTooLarge(ProtocolError):
    pass


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":")).encode()
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(f"message of {len(body)} bytes is over the {MAX_FRAME}-byte limit")
    return _HEADER.pack(MAGIC, VERSION, len(body)) + body


def _recv_exact(sock: socket.socket, n: int, deadline: float | None, buf: bytearray | None = None) -> bytes | None:
    """``n`` bytes (appended to ``buf``'s), all of them by ``deadline`` (monotonic seconds)."""
    buf = bytearray() if buf is None else buf
    start = len(buf)
    while len(buf) - start < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
        part = sock.recv(n - (len(buf) - start))
        if not part:
            if len(buf) == 0:
                return None
            raise ProtocolError("connection closed in the middle of a frame")
        buf += part
    return bytes(buf[start:])


#: once a frame has begun, all of it (header and body) must arrive within this many seconds
#: (``$LMCTL_FRAME_TIMEOUT_S`` sets another: tests of a stalled client make it short)
FRAME_TIMEOUT = float(os.environ.get("LMCTL_FRAME_TIMEOUT_S") or 30.0)


def read_frame(sock: socket.socket, idle_timeout: float | None = None) -> dict[str, Any] | None:
    """One message, or None when the peer closed the connection cleanly. Waiting for a
    message may take up to ``idle_timeout`` (None: forever; then ``TimeoutError``); once its
    first byte has arrived, the whole frame must arrive within ``FRAME_TIMEOUT`` seconds,
    however slowly it trickles."""
    before = sock.gettimeout()
    try:
        sock.settimeout(idle_timeout)
        first = sock.recv(1)
        if not first:
            return None
        deadline = time.monotonic() + FRAME_TIMEOUT
        try:
            head = _recv_exact(sock, _HEADER.size - 1, deadline, bytearray(first))
            assert head is not None
            magic, version, length = _HEADER.unpack(first + head)
            if magic != MAGIC:
                raise ProtocolError("not an lmctl frame (bad magic)")
            if version != VERSION:
                raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
            if length > MAX_FRAME:
                raise FrameTooLarge(f"frame of {length} bytes is over the {MAX_FRAME}-byte limit")
            body = _recv_exact(sock, length, deadline)
        except TimeoutError:
            raise ProtocolError(f"frame not received within {FRAME_TIMEOUT:.0f} s of its first byte") from None
    finally:
        sock.settimeout(before)
    if body is None:
        raise ProtocolError("connection closed in the middle of a frame")
    try:
        msg = json.loads(body)
    except RecursionError:
        raise ProtocolError("frame body is nested too deeply") from None
    except ValueError:
        raise ProtocolError("frame body is not JSON") from None
    if not isinstance(msg, dict):
        raise ProtocolError("frame body is not a JSON object")
    return msg


def send(sock: socket.socket, msg: dict[str, Any]) -> None:
    sock.sendall(encode(msg))
