"""The daemon (``lmctl serve`` as a real process) and the ``lmctl`` command line, run in this
process (``run``: the program's own entry point, ``lmctl.cli.main``, with its streams, stdin
and environment captured, as typer's ``CliRunner`` does) or as a process (``run_process``:
what a test of the process itself needs, such as exit statuses through a real process,
signals, start-up imports and time, and the socket's peer check)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

#: the repository's root: what a child Python needs on its path to import this checkout
ROOT = Path(__file__).resolve().parent.parent


def env_with_path(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with this checkout first on PYTHONPATH."""
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run(*argv: str, stdin: str | None = None, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``lmctl ARGV`` run in this process through the program's entry point, as a process would
    run it (no tty, no colour): its exit status and what it wrote to stdout and stderr, as a
    ``CompletedProcess``. ``env``: the whole environment of the command (as for a process: what
    is not in it is unset meanwhile); None keeps this process's."""
    from typer._click import formatting  # typer's own click (typer >= 0.25 vendors it)
    from typer.testing import CliRunner

    from lmctl.cli import main

    changes: dict[str, str | None] | None = None
    if env is not None:
        changes = {k: None for k in os.environ if k not in env}
        changes.update(env)
    # the help's width as a process without a terminal has it (click: min($COLUMNS or 80, 80) - 2;
    # the runner would force 80)
    cols = (os.environ if env is None else env).get("COLUMNS", "")
    width = max(min(int(cols) if cols.isdigit() else 80, 80) - 2, 50)
    code: object = 0
    with CliRunner().isolation(input=stdin, env=changes) as (out, err, _):
        formatting.FORCED_WIDTH = width  # the runner puts its own value back when it ends
        try:
            main(list(argv))
        except SystemExit as exc:
            code = exc.code
        sys.stdout.flush()
        sys.stderr.flush()
        stdout, stderr = out.getvalue().decode(), err.getvalue().decode()
    rc = code if isinstance(code, int) else (0 if code is None else 1)
    return subprocess.CompletedProcess(["lmctl", *argv], rc, stdout, stderr)


def run_process(*argv: str, stdin: str | None = None, env: Mapping[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -m lmctl.cli ARGV`` as a process of its own (``env``: its environment, default
    this process's), with this checkout on its path."""
    return subprocess.run([sys.executable, "-m", "lmctl.cli", *argv], capture_output=True, text=True,
                          env=env_with_path(env), timeout=timeout, input=stdin)


class Daemon:
    """``lmctl serve`` on ``store`` (socket ``sock``), with ``extra`` options; ``command``
    replaces the whole ``lmctl`` command line where a test needs another one; ``stderr``: where its
    log goes (default: a pipe, read when it stops); ``cwd``: the folder it runs in."""

    def __init__(self, store: Path, sock: Path | None = None, extra: Sequence[str] = (), *,
                 command: Sequence[str] | None = None, env: dict[str, str] | None = None,
                 stderr: Any = subprocess.PIPE, cwd: Path | None = None) -> None:
        self.store = store
        self.sock = sock or store / "lmctl.sock"
        self.command = list(command) if command is not None else [
            "serve", "--store", str(store), "--socket", str(self.sock), "--maintenance-interval", "0.5", *extra]
        self.env = env
        self.stderr = stderr
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        #: how its last stop went (exit status, seconds to exit), and the process it stopped
        self.stopped: tuple[int, float] | None = None
        self.last_proc: subprocess.Popen[str] | None = None

    def start(self, wait: bool = True, timeout: float = 30) -> subprocess.Popen[str]:
        """Start it; with ``wait``, until its socket accepts a connection (an error with its
        stderr if it exits first, or after ``timeout`` seconds)."""
        self.proc = subprocess.Popen([sys.executable, "-m", "lmctl.cli", *self.command],
                                     env=self.env or env_with_path(), stderr=self.stderr, text=True,
                                     cwd=self.cwd)
        if wait:
            end = time.time() + timeout
            while time.time() < end:
                if self.proc.poll() is not None:
                    raise AssertionError(f"daemon exited: {self.proc.stderr.read() if self.proc.stderr else ''}")
                try:
                    with socket.socket(socket.AF_UNIX) as s:
                        s.connect(str(self.sock))
                    return self.proc
                except OSError:
                    time.sleep(0.05)
            raise AssertionError("daemon did not start")
        return self.proc

    def call(self, cmd: str, args: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        """One request through the project's client (a connection of its own)."""
        from lmctl.client import Client

        c = Client(str(self.sock), timeout=timeout)
        try:
            return c.call(cmd, args)
        finally:
            c.close()

    def threads(self) -> int:
        """The daemon's threads now."""
        assert self.proc is not None
        with open(f"/proc/{self.proc.pid}/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("Threads:")))

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then its exit status (a daemon already stopped: that of its stop). Its stderr
        is left unread, for the caller (``proc.stderr`` of the process it was), or ``finish``."""
        if self.proc is None:
            assert self.stopped is not None, "the daemon was never started"
            return self.stopped[0]
        proc, t0 = self.proc, time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=timeout)
        self.proc, self.last_proc = None, proc
        self.stopped = (rc, time.monotonic() - t0)
        return rc

    def finish(self, timeout: float = 60) -> tuple[int, float, str]:
        """``stop``: its exit status, how long it took to exit, and what it wrote to stderr."""
        rc = self.stop(timeout)
        assert self.stopped is not None and self.last_proc is not None
        err = self.last_proc.stderr.read() if self.last_proc.stderr else ""
        return rc, self.stopped[1], err
