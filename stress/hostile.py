"""A second local user, for attacks on a store's folders and socket (the tests' and the
reliability suite's): a throwaway account, and calls made as that user in a forked child
that drops to its uid (no program of the project needs to be readable by it).
"""

from __future__ import annotations

import json
import os
import pwd
import select
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any


class HostileUser:
    """``with HostileUser() as eve:`` a local user made for the block (``useradd``) and removed
    after it (``userdel``). Needs root."""

    def __init__(self, prefix: str = "lmxpriv") -> None:
        self.name = f"{prefix}{uuid.uuid4().hex[:8]}"
        self.uid = self.gid = -1
        self._children: list[int] = []

    def __enter__(self) -> HostileUser:
        subprocess.run(["useradd", "-M", "-U", "-s", "/usr/sbin/nologin", self.name], check=True,
                       capture_output=True, timeout=60)
        pw = pwd.getpwnam(self.name)
        self.uid, self.gid = pw.pw_uid, pw.pw_gid
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for pid in self._children:
            self.stop(pid)
        subprocess.run(["userdel", self.name], capture_output=True, timeout=60)
        subprocess.run(["groupdel", self.name], capture_output=True, timeout=60)

    def _drop(self) -> None:
        os.setgroups([])
        os.setgid(self.gid)
        os.setuid(self.uid)

    def do(self, fn: Callable[..., Any], *args: Any, timeout: float = 30.0) -> Any:
        """``fn(*args)`` run as this user (in a forked child); what it returns (JSON-able), or
        ``AssertionError`` with what it raised. What ``fn`` needs must be imported before:
        the user may not be able to read the project's virtualenv."""
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop to the user, do it, report, exit
            code = 0
            try:
                os.close(r)
                self._drop()
                try:
                    out: dict[str, Any] = {"ok": fn(*args)}
                except Exception as exc:
                    out = {"error": f"{type(exc).__name__}: {exc}"}
                os.write(w, json.dumps(out).encode())
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        deadline = time.monotonic() + timeout
        chunks = []
        try:
            while True:
                ready, _, _ = select.select([r], [], [], max(0.0, deadline - time.monotonic()))
                if not ready:
                    os.kill(pid, signal.SIGKILL)
                    raise AssertionError(f"{fn.__name__} as {self.name} did not finish in {timeout} s")
                data = os.read(r, 65536)
                if not data:
                    break
                chunks.append(data)
        finally:
            os.close(r)
            os.waitpid(pid, 0)
        res = json.loads(b"".join(chunks) or b'{"error": "the child died"}')
        if "error" in res:
            raise AssertionError(f"{fn.__name__} as {self.name}: {res['error']}")
        return res["ok"]

    def spawn(self, fn: Callable[..., Any], *args: Any) -> int:
        """``fn(*args)`` run as this user in a child left running (``stop`` ends it); its pid."""
        pid = os.fork()
        if pid == 0:
            try:
                self._drop()
                fn(*args)
            finally:
                os._exit(0)
        self._children.append(pid)
        return pid

    def stop(self, pid: int) -> None:
        if pid in self._children:
            self._children.remove(pid)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        except ProcessLookupError:
            os.waitpid(pid, 0)


# -- what the user does (run through ``do``/``spawn``) -----------------------------------------
def make_open_folder(path: str) -> int:
    """A folder of the user's, open to all (0777): where a victim may put a store or a tier."""
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o777)
    return os.stat(path).st_uid


def plant_link(path: str, target: str) -> None:
    """``path`` becomes a symbolic link to ``target`` (whatever was there is removed)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.symlink(target, path)


def plant_fifo(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    os.mkfifo(path, 0o666)


def plant_file(path: str, data_hex: str) -> None:
    """``path`` becomes a file of the user's holding ``data`` (another name is swapped in)."""
    tmp = f"{path}.{uuid.uuid4().hex[:6]}"
    with open(tmp, "wb") as f:
        f.write(bytes.fromhex(data_hex))
    os.chmod(tmp, 0o666)
    os.rename(tmp, path)


def fake_daemon(sock_path: str, record: str) -> None:
    """Bind a socket where a victim's CLI looks for its daemon and keep, in ``record``, every
    byte any client sends (then answer each request with a forged reply)."""
    from lmctl import protocol

    os.makedirs(os.path.dirname(sock_path), exist_ok=True)
    with open(record, "wb"):
        pass
    os.chmod(record, 0o644)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(sock_path)
    os.chmod(sock_path, 0o777)
    srv.listen(8)
    while True:
        conn, _ = srv.accept()
        conn.settimeout(2.0)
        try:
            data = conn.recv(1 << 20)
            with open(record, "ab") as f:
                f.write(data)
            if data:
                protocol.send(conn, {"id": 1, "ok": True, "result": {"forged": True}})
        except OSError:
            pass
        finally:
            conn.close()


def wait_for(path: str | Path, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear in {timeout} s")
        time.sleep(0.02)
