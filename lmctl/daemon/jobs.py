"""A running request (``RunningJob``: progress frames, cancellation when its client goes or the daemon
stops) and the state every client thread of the daemon shares."""

from __future__ import annotations

import logging
import os
import select
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from store import Store

from .. import protocol
from ..errors import Cancelled
from ..health import FailedJobs, Maintenance
from ..ops import Job as OpJob

log = logging.getLogger("lmctl.daemon")


#: fault injection for tests: seconds each progress step of a job takes
_FAULT_STEP_DELAY = float(os.environ.get("LMCTL_FAULT_JOB_STEP_DELAY", "0") or 0)


@dataclass
class RunningJob(OpJob):
    """One running request. ``progress`` streams progress frames and is where a job learns
    that it is cancelled: its client hung up (Ctrl-C) or the daemon is stopping."""

    id: int
    cmd: str
    started: float
    conn: socket.socket | None = None
    rid: Any = None
    stopping: threading.Event | None = None
    done: int = 0
    total: int = 0
    what: str = ""
    _last_sent: float = 0.0
    _last_poll: float = 0.0

    def _client_gone(self) -> bool:
        if self.conn is None:
            return False
        try:
            readable, _, _ = select.select([self.conn], [], [], 0)
            return bool(readable) and self.conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _check(self) -> None:
        now = time.monotonic()
        if self.stopping is not None and self.stopping.is_set():
            raise Cancelled(f"{self.cmd} was cancelled: the daemon is stopping "
                            f"(done {self.done} of {self.total or '?'}; run it again when the daemon is back)")
        if now - self._last_poll >= 0.05:
            self._last_poll = now
            if self._client_gone():
                raise Cancelled(f"{self.cmd} was cancelled: its client went away (done {self.done} of {self.total})")

    def progress(self, done: int, total: int, what: str) -> None:
        if _FAULT_STEP_DELAY:
            time.sleep(_FAULT_STEP_DELAY)
        self.done, self.total, self.what = done, total, what
        self._check()
        now = time.monotonic()
        if self.conn is not None and (now - self._last_sent >= 0.1 or done >= total):
            self._last_sent = now
            try:
                protocol.send(self.conn, {"id": self.rid, "progress": {"done": done, "total": total, "what": what}})
            except OSError:
                raise Cancelled(f"{self.cmd} was cancelled: its client went away") from None

    def emit(self, rows: list[dict[str, Any]], into: str = "chunks") -> None:
        self._check()
        if self.conn is None:
            return
        try:
            protocol.send(self.conn, {"id": self.rid, "rows": rows, **({} if into == "chunks" else {"into": into})})
        except OSError:
            raise Cancelled(f"{self.cmd} was cancelled: its client went away") from None


@dataclass
class DaemonState:
    store: Store
    socket_path: str
    started: float = field(default_factory=time.time)
    jobs: dict[int, RunningJob] = field(default_factory=dict)
    requests: int = 0
    errors: int = 0
    maintenance: Maintenance = field(default_factory=lambda: Maintenance(30.0))
    failed_jobs: FailedJobs = field(default_factory=FailedJobs)
    lock: threading.Lock = field(default_factory=threading.Lock)

