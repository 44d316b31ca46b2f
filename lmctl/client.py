"""The CLI's side of the socket: one connection, requests in order, progress streamed."""

from __future__ import annotations

import errno
import itertools
import os
import socket
import stat
import time
from collections.abc import Callable
from typing import Any

from . import protocol

DEFAULT_STORE = "/var/lib/lmctl"


def default_socket() -> str:
    """``$LMCTL_SOCKET``, else ``$LMCTL_STORE/lmctl.sock``, else the default store's socket."""
    if os.environ.get("LMCTL_SOCKET"):
        return os.environ["LMCTL_SOCKET"]
    return os.path.join(os.environ.get("LMCTL_STORE") or DEFAULT_STORE, "lmctl.sock")


def _connect(s: socket.socket, path: str, timeout: float | None) -> None:
    """Connect, waiting up to ``timeout`` while the daemon's queue of connections it has not
    accepted yet is full (a flood of them): a blocking socket waits for room in the kernel,
    but one with a timeout is told EAGAIN at once."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        try:
            s.connect(path)
            return
        except BlockingIOError:
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(errno.ETIMEDOUT, "its queue of new connections stayed full") from None
            time.sleep(0.002)


class Unreachable(Exception):
    def __init__(self, path: str, why: str) -> None:
        super().__init__(f"no lmctl daemon on {path} ({why}); start one with: lmctl serve --store DIR")
        self.path = path


class RemoteError(Exception):
    """The daemon answered with an error."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @classmethod
    def of(cls, reply: dict[str, Any]) -> RemoteError:
        """The error of a reply that is not ok."""
        err = reply.get("error") or {}
        return cls(str(err.get("code", "failed")), str(err.get("message", "unknown error")))


class _Closed(Exception):
    """The daemon closed the connection before answering anything."""


class Client:
    def __init__(self, path: str, timeout: float | None = None) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)

    def connect(self) -> None:
        if self._sock is not None:
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        try:
            _connect(s, self.path, self.timeout)
        except FileNotFoundError:
            s.close()
            raise Unreachable(self.path, "no such socket") from None
        except ConnectionRefusedError:
            s.close()
            if os.path.exists(self.path) and not stat.S_ISSOCK(os.stat(self.path).st_mode):
                raise Unreachable(self.path, "not a socket") from None
            raise Unreachable(self.path, "connection refused: stale socket") from None
        except PermissionError:
            s.close()
            raise Unreachable(self.path, "permission denied") from None
        except OSError as exc:
            s.close()
            raise Unreachable(self.path, exc.strerror or str(exc)) from None
        self._sock = s

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
        reused = self._sock is not None
        try:
            return self._call(cmd, args, progress)
        except _Closed as exc:
            # the daemon hangs up connections idle for long (a shell left open): a kept
            # connection that it closed before answering anything is made anew, once
            self.close()
            if not reused:
                raise Unreachable(self.path, str(exc)) from None
        try:
            return self._call(cmd, args, progress)
        except _Closed as exc:
            self.close()
            raise Unreachable(self.path, str(exc)) from None

    def _call(self, cmd: str, args: dict[str, Any] | None,
              progress: Callable[[int, int, str], None] | None) -> dict[str, Any]:
        self.connect()
        assert self._sock is not None
        rid = next(self._ids)
        rows: list[Any] = []
        heard = False
        try:
            try:
                protocol.send(self._sock, {"id": rid, "cmd": cmd, "args": args or {}})
            except (BrokenPipeError, ConnectionResetError) as exc:
                refusal = self._refusal()
                if refusal is not None:
                    raise refusal from None
                raise _Closed(f"connection lost: {exc}") from None
            while True:
                msg = protocol.read_frame(self._sock, self.timeout)
                if msg is None:
                    if not heard:
                        raise _Closed("the daemon closed the connection")
                    self.close()
                    raise Unreachable(self.path, "the daemon closed the connection")
                heard = True
                if "progress" in msg:
                    if progress is not None:
                        p = msg["progress"]
                        progress(int(p.get("done", 0)), int(p.get("total", 0)), str(p.get("what", "")))
                    continue
                if "rows" in msg:  # a streamed listing: appended to the result's "chunks"
                    rows.extend(msg["rows"] or [])
                    continue
                if msg.get("ok"):
                    result = dict(msg.get("result") or {})
                    if rows:
                        result["chunks"] = list(result.get("chunks") or []) + rows
                    return result
                raise RemoteError.of(msg)
        except (BrokenPipeError, ConnectionResetError) as exc:
            if not heard:
                raise _Closed(f"connection lost: {exc}") from None
            self.close()
            raise Unreachable(self.path, f"connection lost: {exc}") from None
        except TimeoutError:
            self.close()
            raise Unreachable(self.path, f"no answer within {self.timeout} s") from None
        except protocol.ProtocolError as exc:
            self.close()
            raise RemoteError("protocol", str(exc)) from None
        except KeyboardInterrupt:
            # Ctrl-C mid-request: hang up, which cancels the daemon's job
            self.close()
            raise

    def _refusal(self) -> RemoteError | None:
        """The reply a daemon sent before it hung up without reading our request (a refused
        peer, a busy daemon): it is still there to read after our send found the socket shut."""
        assert self._sock is not None
        try:
            msg = protocol.read_frame(self._sock, 1.0)
        except (OSError, protocol.ProtocolError):
            return None
        if msg is None or msg.get("ok") is not False:
            return None
        return RemoteError.of(msg)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
