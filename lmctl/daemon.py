"""``lmctl serve``: the cache-manager daemon on a local Unix socket.

One thread per client connection over one shared ``Store`` (thread-safe); a maintenance
thread that keeps tiers under their high watermark and compacts dead space; clean exit on
SIGTERM/SIGINT. The socket is mode 0600 and peers of another uid are refused (peer
credentials), unless allowed with ``--allow-uid``.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from store import Store, StoreError

from . import __version__, protocol
from .ops import OPS, UsageError

log = logging.getLogger("lmctl.daemon")


@dataclass
class Job:
    id: int
    cmd: str
    started: float
    done: int = 0
    total: int = 0
    what: str = ""


@dataclass
class DaemonState:
    store: Store
    socket_path: str
    started: float = field(default_factory=time.time)
    jobs: dict[int, Job] = field(default_factory=dict)
    clients: int = 0
    requests: int = 0
    errors: int = 0
    maintenance: dict[str, Any] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class AlreadyServing(StoreError):
    pass


def _peer_uid(conn: socket.socket) -> int:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def bind_socket(path: str) -> socket.socket:
    """Bind the daemon's socket. A stale socket (no one listening) is replaced; a live one
    (another daemon) is never taken over; anything that is not a socket is left alone."""
    if os.path.lexists(path):
        st = os.lstat(path)
        if not stat.S_ISSOCK(st.st_mode):
            raise StoreError(f"{path} exists and is not a socket; remove it or choose another --socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(1.0)
        try:
            probe.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            log.warning("replacing stale socket %s (no daemon is listening on it)", path)
            os.unlink(path)
        except OSError as exc:
            raise StoreError(f"cannot check the existing socket {path}: {exc}") from None
        else:
            raise AlreadyServing(f"another lmctl daemon is already serving on {path}")
        finally:
            probe.close()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # the socket is born 0600: no window where others could connect
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


class Daemon:
    def __init__(self, store_dir: str, socket_path: str | None = None, allow_uids: Iterable[int] = (),
                 maintenance_s: float = 30.0) -> None:
        self.store_dir = os.path.abspath(store_dir)
        self.socket_path = os.path.abspath(socket_path or os.path.join(self.store_dir, "lmctl.sock"))
        self.allow = {os.getuid(), *allow_uids}
        self.maintenance_s = maintenance_s
        self._stop = threading.Event()
        self._ids = itertools.count(1)
        self._lockfd: int | None = None

    def _take_lock(self) -> None:
        """Only one daemon per socket: a flock'ed file beside it settles races between starts."""
        os.makedirs(os.path.dirname(self.socket_path), exist_ok=True)
        fd = os.open(self.socket_path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise AlreadyServing(f"another lmctl daemon is already serving on {self.socket_path}") from None
            raise
        self._lockfd = fd

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def serve(self) -> int:
        self._take_lock()
        store = Store(self.store_dir)
        self.state = DaemonState(store, self.socket_path)
        listener = bind_socket(self.socket_path)
        listener.settimeout(0.25)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        maint = threading.Thread(target=self._maintain, name="lmctl-maintenance", daemon=True)
        maint.start()
        log.info("lmctl %s serving store %s on %s (pid %d)", __version__, self.store_dir, self.socket_path,
                 os.getpid())
        threads: list[threading.Thread] = []
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    continue
                except OSError as exc:
                    if self._stop.is_set():
                        break
                    log.warning("accept failed: %s", exc)
                    continue
                t = threading.Thread(target=self._client, args=(conn,), name="lmctl-client", daemon=True)
                t.start()
                threads = [x for x in threads if x.is_alive()] + [t]
        finally:
            log.info("shutting down")
            listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            for t in threads:
                t.join(timeout=5)
            store.close()
            if self._lockfd is not None:
                os.close(self._lockfd)
        return 0

    def _maintain(self) -> None:
        while not self._stop.wait(self.maintenance_s):
            try:
                did = self.state.store.maintain()
                self.state.maintenance = {**did, "at": time.time()}
                if did["evicted"] or did["segments_compacted"]:
                    log.info("maintenance: %s", did)
            except Exception as exc:
                log.warning("maintenance failed: %s", exc)

    # -- one client ----------------------------------------------------------------
    def _client(self, conn: socket.socket) -> None:
        st = self.state
        with conn:
            try:
                uid = _peer_uid(conn)
            except OSError:
                uid = -1
            if uid not in self.allow:
                log.warning("refused a client of uid %d (allowed: %s)", uid, sorted(self.allow))
                self._send(conn, {"id": None, "ok": False, "error": {
                    "code": "denied", "message": f"uid {uid} may not use this daemon (peer credentials)"}})
                return
            with st.lock:
                st.clients += 1
            try:
                while not self._stop.is_set():
                    try:
                        msg = protocol.read_frame(conn)
                    except protocol.ProtocolError as exc:
                        # the stream cannot be trusted after a bad frame: answer, then hang up
                        st.errors += 1
                        self._send(conn, {"id": None, "ok": False, "error": {"code": "protocol", "message": str(exc)}})
                        return
                    except OSError:
                        return
                    if msg is None:
                        return
                    self._handle(conn, msg)
            finally:
                with st.lock:
                    st.clients -= 1

    def _send(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        try:
            protocol.send(conn, msg)
            return True
        except (OSError, protocol.ProtocolError):
            return False

    def _handle(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        st = self.state
        rid = msg.get("id")
        cmd = msg.get("cmd")
        args = msg.get("args", {})
        st.requests += 1

        def fail(code: str, message: str) -> None:
            st.errors += 1
            self._send(conn, {"id": rid, "ok": False, "error": {"code": code, "message": message}})

        if not isinstance(cmd, str) or not isinstance(args, dict):
            return fail("usage", "a request needs 'cmd' (a string) and 'args' (an object)")
        if cmd == "status":
            return self._reply(conn, rid, self._status())
        op = OPS.get(cmd)
        if op is None:
            return fail("usage", f"unknown command {cmd!r}; known: {', '.join(sorted([*OPS, 'status']))}")
        job = Job(next(self._ids), cmd, time.time())
        with st.lock:
            st.jobs[job.id] = job
        last = [0.0]

        def progress(done: int, total: int, what: str) -> None:
            job.done, job.total, job.what = done, total, what
            now = time.monotonic()
            if now - last[0] >= 0.1 or done >= total:
                last[0] = now
                self._send(conn, {"id": rid, "progress": {"done": done, "total": total, "what": what}})

        try:
            result = op(st.store, args, progress)
        except UsageError as exc:
            return fail("usage", str(exc))
        except StoreError as exc:
            return fail("failed", str(exc))
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("%s failed", cmd)
            return fail("failed", f"{cmd} failed: {type(exc).__name__}: {exc}")
        finally:
            with st.lock:
                st.jobs.pop(job.id, None)
        self._reply(conn, rid, result)

    def _reply(self, conn: socket.socket, rid: Any, result: dict[str, Any]) -> None:
        try:
            protocol.send(conn, {"id": rid, "ok": True, "result": result})
        except protocol.FrameTooLarge as exc:
            self._send(conn, {"id": rid, "ok": False, "error": {
                "code": "failed", "message": f"{exc}; narrow the selection (e.g. ls --limit)"}})
        except OSError:
            pass

    def _status(self) -> dict[str, Any]:
        st = self.state
        stats = st.store.stats()
        with st.lock:
            jobs = [{"id": j.id, "cmd": j.cmd, "done": j.done, "total": j.total, "what": j.what,
                     "running_s": round(time.time() - j.started, 3)} for j in st.jobs.values()]
        return {
            "daemon": {"version": __version__, "protocol": protocol.VERSION, "pid": os.getpid(),
                       "uptime_s": round(time.time() - st.started, 3), "socket": st.socket_path,
                       "clients": st.clients, "requests": st.requests, "errors": st.errors,
                       "maintenance": st.maintenance},
            "store": {"path": st.store.path, "tiers": stats["tiers"], "counters": stats["counters"],
                      "write_amplification": round(stats["write_amplification"], 6),
                      "codec": st.store.config.codec},
            "jobs": jobs,
        }
