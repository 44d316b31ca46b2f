"""Reading Redis replies straight into the caller's buffers.

redis-py hands every bulk reply out as a new ``bytes``; a reader that wants a chunk in its own
buffer then copies each piece once more. ``ReplyReader`` reads the replies of pipelined
``GET`` commands from a connection's socket itself: small replies (headers, a chunk's head)
through a scratch buffer, a piece's payload with ``recv_into`` directly into the slice of the
caller's buffer where it belongs. It speaks the part of RESP2/RESP3 that ``GET`` answers with:
a bulk string, a null (``$-1`` or ``_``) or an error (``-...``); anything else is a protocol
error, after which the connection must be closed (its stream position is unknown).

``pack_gets(names)`` builds the request for a pipeline of ``GET`` commands.

A reader that checks what it receives (a MAC, a decryption) passes ``land`` to ``read_into``:
it is called with each span of the buffer once ``STEP`` or more bytes of it have arrived
(less than twice that; the rest at the value's end), so the check runs while the server goes
on sending and the bytes are still in the cache, instead of in a second pass over the whole
buffer, and the check's fixed cost per call is paid per span, not per receive.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Sequence

import redis.exceptions as rx

SCRATCH = 64 * 1024
_MAX_LINE = 1024
#: the most bytes one receive lands in the caller's buffer, and the span ``land`` is given
#: (the rest of a value at its end)
STEP = 256 * 1024


def pack_gets(names: Sequence[str]) -> bytes:
    """The RESP request of ``GET name`` for each name, to send in one write."""
    parts = []
    for name in names:
        b = name.encode()
        parts.append(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(parts)


class ReplyReader:
    """Replies from ``sock`` (whose timeout bounds each receive). Raises ``rx.ConnectionError``
    when the server closes the connection, ``rx.InvalidResponse`` on a reply it does not
    expect, and the socket's ``TimeoutError``/``OSError``."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(SCRATCH)
        self._view = memoryview(self._buf)
        self._start = 0
        self._end = 0

    def _fill(self) -> None:
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        got = self._sock.recv_into(self._view[self._end:])
        if not got:
            raise rx.ConnectionError("the server closed the connection in the middle of a reply")
        self._end += got

    def _line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._start, self._end)
            if i >= 0:
                line = bytes(self._view[self._start:i])
                self._start = i + 2
                return line
            if self._end - self._start > _MAX_LINE:
                raise rx.InvalidResponse("a reply header longer than any the server sends")
            self._fill()

    def header(self) -> int | None | rx.ResponseError:
        """The next reply's header: a bulk string's length (its payload follows: read it with
        ``read_into``, ``read_bytes`` or ``skip``), None for a null, or the error reply."""
        line = self._line()
        kind = line[:1]
        if kind == b"$":
            try:
                n = int(line[1:])
            except ValueError:
                raise rx.InvalidResponse(f"a bulk length that is not a number: {line[:32]!r}") from None
            return None if n < 0 else n
        if kind == b"_":
            return None
        if kind == b"-":
            return rx.ResponseError(line[1:].decode("utf-8", "replace"))
        raise rx.InvalidResponse(f"a reply GET does not give: {line[:32]!r}")

    def read_into(self, dst: memoryview, land: Callable[[memoryview], object] | None = None,
                  end: bool = True) -> None:
        """Exactly ``len(dst)`` payload bytes into ``dst``, then (``end``) the reply's CRLF;
        ``end=False`` leaves the rest of the reply to read (into another buffer). ``land``
        is given each slice of ``dst`` once its bytes are in."""
        n = len(dst)
        have = min(n, self._end - self._start)
        dst[:have] = self._view[self._start:self._start + have]
        self._start += have
        if land is not None and have:
            land(dst[:have])
        pos = marked = have
        step = n if land is None else STEP
        while pos < n:
            got = self._sock.recv_into(dst[pos:pos + step])
            if not got:
                raise rx.ConnectionError("the server closed the connection in the middle of a reply")
            pos += got
            # a receive often brings a few KiB: ``land`` sees spans of STEP (while they are
            # still in the CPU's cache), as each call of a MAC or a cipher has a fixed cost
            if land is not None and (pos - marked >= STEP or pos == n):
                land(dst[marked:pos])
                marked = pos
        if end:
            self.crlf()

    def read_bytes(self, n: int) -> bytes:
        out = bytearray(n)
        self.read_into(memoryview(out))
        return bytes(out)

    def skip(self, n: int) -> None:
        """Pass over ``n`` payload bytes and the CRLF."""
        while n:
            if self._start == self._end:
                self._fill()
            step = min(n, self._end - self._start)
            self._start += step
            n -= step
        self.crlf()

    def skip_reply(self) -> None:
        """Pass over a whole reply of a GET, whatever it is."""
        n = self.header()
        if isinstance(n, int):
            self.skip(n)

    def crlf(self) -> None:
        """The CRLF that ends a bulk reply (after ``read_into(..., end=False)``)."""
        while self._end - self._start < 2:
            self._fill()
        if self._buf[self._start:self._start + 2] != b"\r\n":
            raise rx.InvalidResponse("a bulk reply not ended by CRLF")
        self._start += 2
