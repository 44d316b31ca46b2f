"""The CLI's side of the socket: one connection, requests in order, progress streamed.

Before anything is sent, the client checks who is at the other end (``SO_PEERCRED``): a
daemon of this user, of root, or of a uid the operator names (``--daemon-uid``,
``$LMCTL_DAEMON_UID``: for a daemon run by another user that lets this one in with
``--allow-uid``). Anyone else who bound a socket where the daemon's is expected is refused
(``UntrustedDaemon``) and hears nothing, no cache salt, no request.
"""

from __future__ import annotations

import errno
import itertools
import os
import socket
import stat
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import protocol

DEFAULT_STORE = "/var/lib/lmctl"
#: the uids (or user names, comma-separated) of daemons to trust besides this user's and root's
DAEMON_UID_ENV = "LMCTL_DAEMON_UID"


def parse_daemon_uids(text: str) -> set[int]:
    """``--daemon-uid`` / ``$LMCTL_DAEMON_UID``: uids or user names, comma-separated;
    ``ValueError`` (saying which) for a name that is neither."""
    import pwd

    uids: set[int] = set()
    for word in filter(None, (w.strip() for w in text.split(","))):
        if word.isdigit():
            uids.add(int(word))
            continue
        try:
            uids.add(pwd.getpwnam(word).pw_uid)
        except KeyError:
            raise ValueError(f"--daemon-uid {word!r} is neither a uid nor a user name of this machine") from None
    return uids


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


class UntrustedDaemon(Unreachable):
    """The socket is served by a process of a uid this client does not trust; nothing was sent."""

    def __init__(self, path: str, uid: int) -> None:
        import pwd

        try:
            who = f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
        except KeyError:
            who = f"uid {uid}"
        Exception.__init__(self, f"the socket {path} is served by {who}, which is neither you, root nor a "
                                 f"--daemon-uid; nothing was sent. If that daemon is one to trust, pass "
                                 f"--daemon-uid {uid} (or set {DAEMON_UID_ENV}={uid})")
        self.path = path
        self.uid = uid


class NoAccess(Unreachable):
    """The kernel refused the connection (EACCES): the socket, or a folder on the way to it,
    is another user's, whose daemon may well be running there. Nothing was sent."""

    def __init__(self, path: str) -> None:
        Exception.__init__(self, _no_access(path))
        self.path = path


def _who(uid: int) -> str:
    import pwd

    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _no_access(path: str) -> str:
    me = os.geteuid()
    admit = (f"its owner can admit you: lmctl serve --allow-uid {me}, with the socket where you can reach it "
             "(e.g. --socket /run/lmctl/lmctl.sock --socket-mode 0660 --socket-group GROUP, you in GROUP)")
    try:
        st = os.stat(path)
    except OSError:  # EACCES: a folder on the way keeps this user out
        return (f"permission denied reaching the socket {path}: a folder on the way keeps {_who(me)} out; "
                f"a daemon may be running there: {admit}")
    return (f"permission denied connecting to the socket {path}: it belongs to {_who(st.st_uid)} (mode "
            f"{stat.S_IMODE(st.st_mode):04o}) and {_who(me)} may not write to it; a daemon may be running there: "
            f"{admit}, and you pass --daemon-uid {st.st_uid}")


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
    def __init__(self, path: str, timeout: float | None = None, daemon_uids: Iterable[int] | None = None) -> None:
        """``daemon_uids``: the uids of daemons to trust besides this user's and root's (None:
        those ``$LMCTL_DAEMON_UID`` names)."""
        self.path = path
        self.timeout = timeout
        if daemon_uids is None:
            daemon_uids = parse_daemon_uids(os.environ.get(DAEMON_UID_ENV, ""))
        self.trusted = {os.geteuid(), os.getuid(), 0, *daemon_uids}
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
            raise NoAccess(self.path) from None
        except OSError as exc:
            s.close()
            raise Unreachable(self.path, exc.strerror or str(exc)) from None
        try:  # who is listening, before a single byte (a salt) goes out
            uid = protocol.peer_uid(s)
        except OSError as exc:
            s.close()
            raise Unreachable(self.path, f"cannot tell who serves the socket: {exc.strerror or exc}") from None
        if uid not in self.trusted:
            s.close()
            raise UntrustedDaemon(self.path, uid)
        self._sock = s

    def call(self, cmd: str, args: dict[str, Any] | None = None,
             progress: Callable[[int, int, str], None] | None = None,
             sink: dict[str, list[Any]] | None = None) -> dict[str, Any]:
        """One request; its result. ``sink``: where streamed rows collect as they come (by the
        list they go into), so that a caller interrupted part way still has those it got."""
        reused = self._sock is not None
        try:
            return self._call(cmd, args, progress, sink)
        except _Closed as exc:
            # the daemon hangs up connections idle for long (a shell left open): a kept
            # connection that it closed before answering anything is made anew, once
            self.close()
            if not reused:
                raise Unreachable(self.path, str(exc)) from None
        try:
            return self._call(cmd, args, progress, sink)
        except _Closed as exc:
            self.close()
            raise Unreachable(self.path, str(exc)) from None

    def _call(self, cmd: str, args: dict[str, Any] | None, progress: Callable[[int, int, str], None] | None,
              sink: dict[str, list[Any]] | None = None) -> dict[str, Any]:
        self.connect()
        assert self._sock is not None
        rid = next(self._ids)
        rows: dict[str, list[Any]] = {} if sink is None else sink
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
                if "rows" in msg:  # a streamed listing: appended to the result's "chunks" (or "into")
                    into = msg.get("into", "chunks")
                    rows.setdefault(into if isinstance(into, str) else "chunks", []).extend(msg["rows"] or [])
                    continue
                if msg.get("ok"):
                    result = dict(msg.get("result") or {})
                    for into, got in rows.items():
                        result[into] = list(result.get(into) or []) + got
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
