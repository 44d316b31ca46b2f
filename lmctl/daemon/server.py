"""``lmctl serve``'s server: the accept loop (peers checked before they cost a thread), a thread
per client, each request dispatched to its operation, ``status`` and ``metrics``, the
maintenance and memory-release threads, and a clean stop."""

from __future__ import annotations

import errno
import itertools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterable
from typing import Any

from store import StoreError

from .. import __version__, protocol
from ..endurance import endurance
from ..errors import Cancelled, Denied, UsageError
from ..health import HIGH_WATERMARK, Maintenance, describe_pass, error_line, utc
from ..health import reasons as health_reasons
from ..ops import OPS
from ..selection import set_caller
from ..settings import maintenance_interval
from .access import SocketUnreachable, bind_socket, changes_the_store, check_socket_path, refuse, socket_access_problem
from .folders import Folders
from .jobs import DaemonState, RunningJob

log = logging.getLogger("lmctl.daemon")


#: how long a stopping daemon waits for running jobs to notice they are cancelled
SHUTDOWN_GRACE_S = 30.0
#: clients served at once; one more is told the daemon is busy and hung up on
MAX_CLIENTS = 64
#: a connection with no request for this long is closed (clients reconnect on their own)
IDLE_TIMEOUT_S = 300.0
#: a refused peer's uid is logged at most this often (a flood of them is counted, not logged)
DENIED_LOG_EVERY_S = 60.0
#: a reply or progress frame the client does not take in within this long ends the connection
WRITE_TIMEOUT_S = 30.0
#: after a request, the index's mapped pages are dropped from the daemon's memory once more
#: than this is resident (a lookup maps a few pages; a pass over a large index, all of them)
RELEASE_ABOVE = 64 << 20


def sd_notify(state: str) -> bool:
    """Tell the service manager how the daemon is (systemd's ``Type=notify``: ``READY=1``,
    ``STOPPING=1``): one datagram to ``$NOTIFY_SOCKET`` (a path, or ``@name`` for an abstract
    socket). Without it, does nothing; a send that fails is logged, never fatal. Whether it
    was sent."""
    addr = os.environ.get("NOTIFY_SOCKET", "")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    elif not addr.startswith("/"):
        log.warning("NOTIFY_SOCKET=%s is neither a path nor @name: readiness not reported", addr)
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(5.0)
            s.connect(addr)
            s.sendall(state.encode())
        return True
    except OSError as exc:
        log.warning("could not notify the service manager (%s) on NOTIFY_SOCKET: %s", state.split("\n")[0], exc)
        return False


class Daemon:
    def __init__(self, store_dir: str, socket_path: str | None = None, allow_uids: Iterable[int] = (),
                 maintenance_s: float = 30.0, socket_mode: int = 0o600, socket_group: int | None = None, *,
                 init: bool = True, settings: dict[str, Any] | None = None, metrics: str | None = None,
                 allow_ro_uids: Iterable[int] = ()) -> None:
        self.store_dir = os.path.abspath(store_dir)
        self.socket_path = os.path.abspath(socket_path or os.path.join(self.store_dir, "lmctl.sock"))
        check_socket_path(self.socket_path, given=socket_path is not None)
        self.allow = {os.getuid(), *allow_uids}
        #: uids that may read (status, ls, lookup, ...) and change nothing; full access wins
        self.allow_ro = set(allow_ro_uids) - self.allow
        self.socket_mode = socket_mode
        self.socket_group = socket_group
        self.maintenance_s = maintenance_interval(maintenance_s)
        self.metrics = metrics
        if metrics is not None:
            from ..metrics import parse_listen

            parse_listen(metrics)  # a bad address is a usage error before anything starts
        self._stop = threading.Event()
        self._release = threading.Event()
        self._ids = itertools.count(1)
        self.folders = Folders(self.store_dir, self.socket_path, init, dict(settings or {}))
        self._conns: dict[socket.socket, RunningJob | None] = {}
        self._conns_lock = threading.Lock()
        self._denied: dict[int, tuple[float, int]] = {}  # uid: (last logged, refused since)

    def stop(self, *_: Any) -> None:
        self._stop.set()

    def _check_access(self) -> None:
        problem = socket_access_problem(self.socket_path, self.store_dir, self.socket_mode, self.socket_group,
                                        self.allow | self.allow_ro)
        if problem is not None:
            raise SocketUnreachable(
                f"{'--allow-uid/--allow-uid-ro' if self.allow_ro else '--allow-uid'}: {problem}; pass e.g. "
                "--socket /run/lmctl/lmctl.sock --socket-mode 0660 "
                "--socket-group lmctl (a folder that user can pass through, a group it is in)")

    def serve(self) -> bool:
        """Serve until SIGTERM/SIGINT; True when every client thread finished and the store was
        closed, False when some request did not stop in time (the store is crash-safe). The
        socket's lock file is removed when the daemon stops, and when a start that took it is
        refused after all."""
        self._check_access()  # before anything is created
        self.folders.check_socket_folder()
        self.folders.check_store()
        try:
            self.folders.take_lock()
        except OSError as exc:
            if exc.errno == errno.EROFS:
                raise StoreError(f"the socket's folder {os.path.dirname(self.socket_path)} is on a read-only "
                                 "filesystem; to serve the store read-only, give --socket a path on a writable one "
                                 "(e.g. /run/lmctl/lmctl.sock)") from None
            raise StoreError(f"cannot use the socket folder for {self.socket_path}: {exc.strerror}") from None
        try:
            return self._serve_locked()
        finally:
            self.folders.release_lock()
            self.folders.release_store_lock()
            self.folders.undo_init()

    def _serve_locked(self) -> bool:
        self._check_access()  # now that the socket's folder exists
        exporter = None
        if self.metrics is not None:  # before the store is opened (or created): a port in use changes nothing
            from ..metrics import Exporter

            exporter = Exporter(self.metrics, lambda: self.state.store, self._exporter_extra)
            self.metrics_port = exporter.port
        try:
            store = self.folders.open_store()
        except BaseException:
            if exporter is not None:
                exporter.close()
            raise
        self.folders.store_opened = True
        self.state = DaemonState(store, self.socket_path, maintenance=Maintenance(self.maintenance_s))
        try:
            listener = bind_socket(self.socket_path, self.socket_mode, self.socket_group)
        except BaseException:
            if exporter is not None:
                exporter.close()
            store.close()
            raise
        listener.settimeout(0.25)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self.stop)
        maint = threading.Thread(target=self._maintain, name="lmctl-maintenance", daemon=True)
        maint.start()
        releaser = threading.Thread(target=self._releaser, name="lmctl-release", daemon=True)
        releaser.start()
        log.info("lmctl %s serving store %s on %s (pid %d)", __version__, self.store_dir, self.socket_path,
                 os.getpid())
        for note in store.notes():
            log.warning("%s", note)
        threads: list[threading.Thread] = []
        # the socket is listening and the store open: a Type=notify unit is started now
        sd_notify(f"READY=1\nMAINPID={os.getpid()}\nSTATUS=serving {self.store_dir} on {self.socket_path}")
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
                # who is calling, before the connection counts against the limit or costs a thread
                try:
                    uid = protocol.peer_uid(conn)
                except OSError:
                    uid = -1
                if uid not in self.allow and uid not in self.allow_ro:
                    self._deny(conn, uid)
                    continue
                threads = [x for x in threads if x.is_alive()]
                if len(threads) >= MAX_CLIENTS:
                    self._busy_reply(conn, len(threads))
                    continue
                conn.settimeout(WRITE_TIMEOUT_S)  # sends; reads set their own deadlines
                t = threading.Thread(target=self._client, args=(conn, uid, uid in self.allow_ro), name="lmctl-client",
                                     daemon=True)
                t.start()
                threads.append(t)
        finally:
            log.info("shutting down")
            sd_notify("STOPPING=1")
            self._stop.set()
            listener.close()
            try:
                os.unlink(self.socket_path)
            except FileNotFoundError:
                pass
            if exporter is not None:
                exporter.close()
            self._release.set()
            clean = self._drain([*threads, maint, releaser])
            if clean:
                store.close()
        return clean

    def _drain(self, threads: list[threading.Thread]) -> bool:
        """Wake idle clients (they are hung up on) and let running jobs stop: each one is
        cancelled at its next progress step and answers its client with why. True when every
        client thread finished, so the store can be closed under no one."""
        with self._conns_lock:
            idle = [c for c, job in self._conns.items() if job is None]
        for conn in idle:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        end = time.monotonic() + SHUTDOWN_GRACE_S
        for t in threads:
            t.join(timeout=max(0.0, end - time.monotonic()))
        left = [t for t in threads if t.is_alive()]
        if left:
            with self._conns_lock:
                jobs = [j.cmd for j in self._conns.values() if j is not None]
            log.error("%d request(s) (%s) did not stop within %.0f s; exiting without closing the store "
                      "(it is crash-safe)", len(left), ", ".join(jobs) or "reading", SHUTDOWN_GRACE_S)
            return False
        return True

    def _releaser(self) -> None:
        """After requests: drop the index's mapped pages from memory when more than
        ``RELEASE_ABOVE`` bytes of it are resident. Off the requests' path, so a lookup never
        waits for the pages a long listing left behind to be unmapped."""
        while not self._stop.is_set():
            self._release.wait()
            self._release.clear()
            if self._stop.is_set():
                return
            try:
                self.state.store.release_memory(above=RELEASE_ABOVE)
            except Exception as exc:  # a closed or failing store: the next request tries again
                log.debug("releasing the index's pages failed: %s", exc)

    def _maintain(self) -> None:
        while not self._stop.wait(self.maintenance_s):
            self._maintain_once()

    def _maintain_once(self) -> None:
        """One maintenance pass, its outcome recorded for ``status``, the health check and the
        metrics. A failure is logged as one line (with the traceback once, at the first failure
        of a run of them, for whoever debugs it); the next pass tries again."""
        st = self.state
        m = st.maintenance
        with st.lock:
            m.running_since = time.time()
        try:
            did = st.store.maintain(HIGH_WATERMARK).to_dict()
        except Exception as exc:
            line = error_line(exc)
            with st.lock:
                m.running_since = None
                m.failed(line, time.time())
                n, since, total = m.consecutive_failures, m.failing_since, m.failures_total
            if n == 1:
                log.warning("maintenance failed: %s", line, exc_info=True)
            else:
                log.warning("maintenance failed again (%d passes in a row since %s, %d in all): %s", n,
                            utc(since or 0), total, line)
        else:
            with st.lock:
                m.running_since = None
                was = m.consecutive_failures
                m.succeeded(did, time.time())
            if was:
                log.info("maintenance works again after %d failed pass(es): %s", was, describe_pass(did))
            elif any(did.values()):
                log.info("maintenance: %s", describe_pass(did))
        try:
            above = {name: t.disk_bytes / t.capacity for name, t in st.store.stats().tiers.items()
                     if t.capacity and t.disk_bytes > HIGH_WATERMARK * t.capacity}
        except Exception as exc:  # a closed or failing store: the status request that asks says so
            log.debug("reading the tiers' usage after maintenance failed: %s", exc)
            above = {}
        with st.lock:
            m.above_watermark = above

    # -- one client ----------------------------------------------------------------
    def _client(self, conn: socket.socket, uid: int, readonly: bool = False) -> None:
        """Serve an allowed peer (``uid``, checked at accept; ``readonly``: one of
        ``--allow-uid-ro``) until it hangs up."""
        st = self.state
        set_caller(uid)  # every request of this connection is this uid's
        with conn:
            with self._conns_lock:
                self._conns[conn] = None
            try:
                while not self._stop.is_set():
                    try:
                        msg = protocol.read_frame(conn, IDLE_TIMEOUT_S)
                    except protocol.ProtocolError as exc:
                        # the stream cannot be trusted after a bad frame: answer, then hang up
                        st.errors += 1
                        self._send(conn, {"id": None, "ok": False, "error": {"code": "protocol", "message": str(exc)}})
                        return
                    except OSError:
                        return
                    if msg is None or self._stop.is_set():
                        return
                    self._handle(conn, msg, uid if readonly else None)
            finally:
                with self._conns_lock:
                    self._conns.pop(conn, None)

    def _clients(self) -> int:
        """Clients connected now (each one's running job, or None, is kept in ``_conns``)."""
        with self._conns_lock:
            return len(self._conns)

    def _busy_reply(self, conn: socket.socket, n: int) -> None:
        """Over the connection cap: one error reply, then hang up (never a thread)."""
        log.warning("refused a client: %d clients connected (the limit)", n)
        refuse(conn, "failed", f"the daemon is busy: {n} clients connected, the most it serves at once; "
                                "try again shortly")

    def _deny(self, conn: socket.socket, uid: int) -> None:
        """A peer whose uid is not allowed: one reply without waiting, then hang up. It costs
        the accept loop a few system calls, never a slot, a thread or a wait; the log says so
        once a minute per uid, however fast the connections come."""
        now = time.monotonic()
        seen = self._denied.get(uid)
        if seen is None or now - seen[0] >= DENIED_LOG_EVERY_S:
            more = f" ({seen[1]} more refused since the last report)" if seen is not None and seen[1] else ""
            log.warning("refused a client of uid %d (allowed: %s%s)%s", uid, sorted(self.allow),
                        f"; read-only: {sorted(self.allow_ro)}" if self.allow_ro else "", more)
            self._denied[uid] = (now, 0)
            if len(self._denied) > 1024:  # uids come from the kernel, but stay bounded anyway
                self._denied = {uid: self._denied[uid]}
        else:
            self._denied[uid] = (seen[0], seen[1] + 1)
        refuse(conn, "denied", f"uid {uid} may not use this daemon (peer credentials); the daemon's owner "
                                f"(uid {os.geteuid()}) can admit it: lmctl serve --allow-uid {uid}")

    def _send(self, conn: socket.socket, msg: dict[str, Any]) -> bool:
        try:
            protocol.send(conn, msg)
            return True
        except (OSError, protocol.ProtocolError):
            return False

    def _handle(self, conn: socket.socket, msg: dict[str, Any], readonly_uid: int | None = None) -> None:
        """Answer one request; ``readonly_uid``: the uid of a read-only peer (``--allow-uid-ro``),
        whose requests that would change the store are ``denied``."""
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
        if readonly_uid is not None and cmd in OPS:  # an unknown command is a usage error, below
            change = changes_the_store(cmd, args)
            if change is not None:
                log.info("denied %s to read-only uid %d", change, readonly_uid)
                return fail("denied", f"uid {readonly_uid} may only read this store (serve --allow-uid-ro): "
                                      f"{change} changes it; --dry-run shows what it would do, or ask the store's "
                                      f"owner (uid {os.geteuid()})")
        if cmd == "status":
            return self._reply(conn, rid, self._status())
        if cmd == "metrics":
            return self._reply(conn, rid, self._metrics())
        op = OPS.get(cmd)
        if op is None:
            return fail("usage", f"unknown command {cmd!r}; known: {', '.join(sorted([*OPS, 'metrics', 'status']))}")
        job = RunningJob(next(self._ids), cmd, time.time(), conn, rid, self._stop)
        with st.lock:
            st.jobs[job.id] = job
        with self._conns_lock:
            self._conns[conn] = job
        try:
            result = op(st.store, args, job)
        except UsageError as exc:
            return fail("usage", str(exc))
        except Denied as exc:
            return fail("denied", str(exc))
        except Cancelled as exc:
            log.info("job %d (%s) cancelled: %s", job.id, cmd, exc)
            return fail("cancelled", str(exc))
        except StoreError as exc:
            self._job_failed(job, str(exc))
            return fail("failed", str(exc))
        except RecursionError:
            return fail("usage", f"{cmd}: the request is nested too deeply")
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("%s failed", cmd)
            message = f"{cmd} failed: {error_line(exc)}"
            self._job_failed(job, message)
            return fail("failed", message)
        finally:
            self._release.set()  # the releaser drops the index's pages if too many are mapped
            with st.lock:
                st.jobs.pop(job.id, None)
            with self._conns_lock:
                if conn in self._conns:
                    self._conns[conn] = None
        self._reply(conn, rid, result)

    def _job_failed(self, job: RunningJob, message: str) -> None:
        with self.state.lock:
            self.state.failed_jobs.add(job.id, job.cmd, time.time(), message)

    def _reply(self, conn: socket.socket, rid: Any, result: dict[str, Any]) -> None:
        try:
            protocol.send(conn, {"id": rid, "ok": True, "result": result})
        except protocol.FrameTooLarge as exc:
            self._send(conn, {"id": rid, "ok": False, "error": {
                "code": "failed", "message": f"{exc}; narrow the selection (e.g. ls --limit)"}})
        except OSError:
            pass

    def _metrics(self) -> dict[str, Any]:
        """``status`` and the store's metric cells (every process's counts; see lmctl top)."""
        cells = [{"name": c.name, "labels": c.labels, "value": c.value, "count": c.count, "sum": c.sum}
                 for c in self.state.store.metric_cells()]
        gauges = [{"name": g.name, "labels": g.labels, "value": g.value, "time": g.time}
                  for g in self.state.store.metric_gauges()]
        return {"time": time.time(), "status": self._status(), "cells": cells, "gauges": gauges}

    def _exporter_extra(self) -> dict[str, Any]:
        st = self.state
        with st.lock:
            jobs: dict[str, int] = {}
            for j in st.jobs.values():
                jobs[j.cmd] = jobs.get(j.cmd, 0) + 1
            failures = st.maintenance.failures_total
        return {"jobs": jobs, "requests": st.requests, "errors": st.errors, "maintenance_failures": failures}

    def _status(self) -> dict[str, Any]:
        st = self.state
        stats = st.store.stats()
        with st.lock:
            jobs = [{"id": j.id, "cmd": j.cmd, "done": j.done, "total": j.total, "what": j.what,
                     "running_s": round(time.time() - j.started, 3)} for j in st.jobs.values()]
            maintenance = st.maintenance.to_dict()
            above = dict(st.maintenance.above_watermark)
            failed = st.failed_jobs.to_list()
        out = {
            "daemon": {"version": __version__, "protocol": protocol.VERSION, "pid": os.getpid(),
                       "uptime_s": round(time.time() - st.started, 3), "socket": st.socket_path,
                       "clients": self._clients(), "requests": st.requests, "errors": st.errors,
                       "maintenance": maintenance},
            "store": {"path": st.store.path, "readonly": st.store.readonly, "readonly_reason": st.store.readonly_reason,
                      "refused_saves": st.store.refused_saves, "tiers": stats.to_dict()["tiers"],
                      "counters": stats.counters,
                      "write_amplification": round(stats.write_amplification, 6),
                      "codec": st.store.config.codec, "remote": stats.remote,
                      "remote_refused": stats.remote_refused, "notes": st.store.notes(),
                      **endurance(st.store)},
            "jobs": jobs,
            "failed_jobs": failed,
        }
        why = health_reasons(out, st.store.unavailable_tiers(), above, st.store.config.default_tier)
        out["health"] = {"healthy": not why, "reasons": why}
        return out
