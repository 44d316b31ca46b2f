"""A second local user for attack tests and scenarios: made for the occasion (root only),
removed afterwards, and code run as that user in a forked child, so the kernel (peer
credentials, file modes) sees a real other uid.

A child inherits the parent's imported modules: it runs the project's own code (the client,
the CLI) with no need to reach the interpreter's files as that user.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

# imported here, before any child is forked: a child running as another user may not be able
# to read the interpreter's or the project's files
from lmctl import protocol
from lmctl.client import Client, RemoteError


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int


@contextmanager
def throwaway_user(prefix: str = "lmx_dmn") -> Iterator[User]:
    """A new user with a group of its own and no home (``useradd``); removed on exit."""
    import pwd

    name = f"{prefix}{uuid.uuid4().hex[:8]}"
    subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True,
                   timeout=60)
    try:
        pw = pwd.getpwnam(name)
        yield User(name, pw.pw_uid, pw.pw_gid)
    finally:
        subprocess.run(["userdel", name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", name], capture_output=True, timeout=60)  # left when userdel keeps it


class AsUser:
    """``fn(*args, stop_fd)`` running as ``user`` in a forked child; ``stop_fd`` becomes
    readable when ``finish`` is called, and ``finish`` returns what ``fn`` returned (JSON)."""

    #: the parent's ends of the pipes of children still running: a later child must not hold
    #: them open (an earlier child would never see its stop, nor its parent its end)
    _parent_ends: set[int] = set()

    def __init__(self, user: User, fn: Callable[..., Any], *args: Any) -> None:
        out_r, out_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:  # the child: drop to the user, run, report, exit (never back into the caller)
            code = 0
            try:
                for fd in (out_r, self._stop_w, *AsUser._parent_ends):
                    os.close(fd)
                os.setgroups([])
                os.setgid(user.gid)
                os.setuid(user.uid)
                try:
                    result: Any = {"result": fn(*args, self._stop_r)}
                except BaseException as exc:
                    result = {"raised": f"{type(exc).__name__}: {exc}"}
                data = json.dumps(result).encode()
                view = memoryview(data)
                while view:
                    view = view[os.write(out_w, view):]
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(out_w)
        os.close(self._stop_r)
        self._out = out_r
        AsUser._parent_ends |= {out_r, self._stop_w}

    def finish(self) -> Any:
        AsUser._parent_ends -= {self._out, self._stop_w}
        os.close(self._stop_w)
        chunks = []
        while data := os.read(self._out, 1 << 16):
            chunks.append(data)
        os.close(self._out)
        _, status = os.waitpid(self.pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not chunks:
            raise RuntimeError(f"the child running as another user failed (status {status})")
        got = json.loads(b"".join(chunks))
        if "raised" in got:
            raise RuntimeError(f"as another user: {got['raised']}")
        return got["result"]


def as_user(user: User, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` run as ``user``; what it returns (JSON-serialisable)."""
    return AsUser(user, lambda *a: fn(*a[:-1]), *args).finish()


def call(sock: str, cmd: str, args: dict[str, Any] | None = None) -> dict[str, Any]:
    """One request through the project's client: ``{"ok": result}`` or ``{"error", "message"}``."""
    c = Client(sock, timeout=30)
    try:
        return {"ok": c.call(cmd, args)}
    except RemoteError as exc:
        return {"error": exc.code, "message": str(exc)}
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    finally:
        c.close()


def cli(*argv: str) -> dict[str, Any]:
    """The ``lmctl`` command line run in this process (testsupport's ``run``): its exit status
    and output (as another user, run it once as this one first: the modules it imports lazily
    must be loaded)."""
    from testsupport.lmctl import run

    r = run(*argv)
    return {"rc": r.returncode, "stdout": r.stdout, "stderr": r.stderr}


def flood(sock: str, hold: int, stop_fd: int) -> dict[str, int]:
    """Connect to ``sock`` as fast as possible until ``stop_fd`` is readable, each connection
    sending a request and never reading; the newest ``hold`` are kept open (a peer that
    lingers). Returns the connections made and the attempts that failed."""
    frame = protocol.encode({"id": 1, "cmd": "status", "args": {}})
    held: deque[socket.socket] = deque()
    made = failed = 0
    while not select.select([stop_fd], [], [], 0)[0]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(5)
        try:
            s.connect(sock)
            s.send(frame)
        except OSError:
            failed += 1
            s.close()
            continue
        made += 1
        held.append(s)
        if len(held) > hold:
            held.popleft().close()
    for s in held:
        s.close()
    return {"connections": made, "failed": failed}


def threads_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line.split()[1] for line in f if line.startswith("Threads:")))


def is_root() -> bool:
    return os.geteuid() == 0 and sys.platform.startswith("linux")


@contextmanager
def open_folder() -> Iterator[str]:
    """A fresh folder every user may pass through and list (0755): where a socket or files
    that another user must reach go (a test's own temporary folder is private)."""
    import shutil
    import tempfile

    path = tempfile.mkdtemp(prefix="lmctl-shared-", dir="/tmp")
    try:
        os.chmod(path, 0o755)
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
