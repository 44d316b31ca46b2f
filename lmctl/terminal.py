"""The CLI's terminal: where a command's output goes, and the one rule from how a command
ended to its exit status.

* ``ExitStatus`` names every exit code (SPEC section 6, and 130 for Ctrl-C).
* ``classify`` maps whatever a command ended with (an error reply, an unreachable daemon,
  an option the parser refused, Ctrl-C, a bug) to ``(exit status, error code, message)``;
  nothing else decides an exit code.
* ``Terminal`` carries the streams, whether stdout is a terminal, colour and ``--json``,
  and the connection to the daemon. It is passed to every command as the click context's
  object, so a command runs in-process (typer's ``CliRunner``, the shell) exactly as in
  its own process.

Imports neither the store library nor rich at module level: ``lmctl --help`` starts fast.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import Any, Literal, TextIO

import typer

from .client import Client, RemoteError, Unreachable, UntrustedDaemon, default_socket


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1  # the operation failed
    USAGE = 2  # a bad or conflicting option, a missing selector, an unknown name
    UNREACHABLE = 3  # no daemon on the socket (or none to trust: another user's)
    INTERRUPTED = 130  # Ctrl-C: the daemon cancels the job


#: every error code of a reply or of the CLI itself, and its exit status
ERROR_EXIT = {"usage": ExitStatus.USAGE, "failed": ExitStatus.ERROR, "protocol": ExitStatus.ERROR,
              "denied": ExitStatus.ERROR, "cancelled": ExitStatus.ERROR, "unreachable": ExitStatus.UNREACHABLE,
              "untrusted": ExitStatus.UNREACHABLE, "interrupted": ExitStatus.INTERRUPTED}


class CommandError(Exception):
    """A command cannot go on; ``code`` is an error code of ``ERROR_EXIT`` (usage, failed)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Failure:
    """How a command failed: its exit status, error code and one-line message."""

    status: ExitStatus
    code: str
    message: str

    @classmethod
    def of(cls, code: str, message: str) -> Failure:
        # one line, whatever the message held
        return cls(ERROR_EXIT.get(code, ExitStatus.ERROR), code, " ".join(str(message).split()))


def classify(exc: BaseException) -> Failure:
    """The one rule: what a command that ended with ``exc`` exits with and says."""
    from typer import _click as click  # typer's own click (typer >= 0.25 vendors it)

    if isinstance(exc, UntrustedDaemon):
        return Failure.of("untrusted", str(exc))
    if isinstance(exc, Unreachable):
        return Failure.of("unreachable", str(exc))
    if isinstance(exc, (RemoteError, CommandError)):
        return Failure.of(exc.code, str(exc))
    if isinstance(exc, KeyboardInterrupt):
        return Failure.of("interrupted", "interrupted; the daemon cancels the job (changes made so far stay)")
    if isinstance(exc, typer.Abort):  # end of input while the parser read a value
        return Failure.of("interrupted", "interrupted")
    if isinstance(exc, click.exceptions.UsageError):
        where = exc.ctx.command_path if exc.ctx is not None else "lmctl"
        return Failure.of("usage", f"{exc.format_message()} (see {where} --help)")
    if isinstance(exc, click.exceptions.ClickException):
        return Failure.of("usage", exc.format_message())
    return Failure.of("failed", f"internal error: {type(exc).__name__}: {exc}")  # a bug: never a traceback


def human(n: float) -> str:
    """A byte count for people: 512 B, 1.5 MiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@dataclass
class Terminal:
    """Where a command's output goes and how it looks, and its connection to the daemon.

    ``stdout``/``stderr`` None mean the process's streams at the time of writing;
    ``is_tty`` None means "ask stdout"; ``color`` None lets rich decide (a terminal,
    ``$NO_COLOR``, ``$FORCE_COLOR``), False never colours, True always does."""

    json: bool = False
    stdout: TextIO | None = None
    stderr: TextIO | None = None
    is_tty: bool | None = None
    color: bool | None = None
    socket: str = field(default_factory=default_socket)
    socket_given: bool = False  # --socket or $LMCTL_SOCKET named it (serve then uses it)
    daemon_uids: frozenset[int] | None = None  # --daemon-uid (None: $LMCTL_DAEMON_UID's)
    keep_open: bool = False  # the shell keeps one connection for the whole session
    client: Client | None = None

    @staticmethod
    def of(ctx: typer.Context) -> Terminal:
        """The terminal a command runs in (the root context's object)."""
        obj = ctx.find_root().obj
        assert isinstance(obj, Terminal)
        return obj

    def without_json(self) -> Terminal:
        """The same streams, errors as lines (commands whose output is never JSON)."""
        return replace(self, json=False, client=None)

    # -- output ---------------------------------------------------------------------------
    @property
    def out(self) -> TextIO:
        return self.stdout if self.stdout is not None else sys.stdout

    @property
    def err(self) -> TextIO:
        return self.stderr if self.stderr is not None else sys.stderr

    def echo(self, text: str = "", end: str = "\n") -> None:
        print(text, end=end, file=self.out)

    def console(self) -> Any:
        """A rich console on stdout. Lines are never broken inside a value; piped output gets
        room for wide tables."""
        from rich.console import Console

        tty = self.is_tty if self.is_tty is not None else self.out.isatty()
        return Console(file=self.stdout, highlight=False, soft_wrap=True, width=None if tty else 200,
                       force_terminal=self.is_tty, color_system=self._color_system())

    def _color_system(self) -> Literal["auto", "standard"] | None:
        return "auto" if self.color is None else "standard" if self.color else None

    def table(self, title: str | None, cols: list[str], rows: list[list[str]], right: set[str] | None = None) -> None:
        from rich.table import Table

        t = Table(title=title)
        for c in cols:
            t.add_column(c, justify="right" if right and c in right else "left")
        for r in rows:
            t.add_row(*r)
        self.console().print(t)

    def emit(self, result: dict[str, Any], show: Callable[[Terminal, dict[str, Any]], None]) -> None:
        """A command's result: JSON under ``--json`` (numbers as numbers), else ``show``."""
        if self.json:
            self.echo(json.dumps(result))
        else:
            show(self, result)

    @contextmanager
    def progress(self) -> Iterator[Callable[[int, int, str], None]]:
        """A progress bar on stderr while a long job runs (shown only when stderr is a terminal)."""
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        console = Console(file=self.stderr, stderr=True, color_system=self._color_system())
        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       console=console, transient=True, disable=not console.is_terminal)
        task = None
        with bar:
            def update(done: int, total: int, what: str) -> None:
                nonlocal task
                if task is None:
                    task = bar.add_task(what or "working", total=total or None)
                bar.update(task, completed=done, total=total or None, description=what or "working")

            yield update

    # -- failures -------------------------------------------------------------------------
    def show_failure(self, failure: Failure) -> int:
        """Print a failure as one line (stderr) or a JSON object (stdout); its exit status."""
        if self.json:
            self.echo(json.dumps({"error": {"code": failure.code, "message": failure.message,
                                            "exit": int(failure.status)}}))
        else:
            print(f"lmctl: {failure.message}", file=self.err)
        return int(failure.status)

    def report(self, code: str, message: str) -> int:
        return self.show_failure(Failure.of(code, message))

    def fail(self, exc: BaseException) -> int:
        return self.show_failure(classify(exc))

    def run(self, body: Callable[[], None]) -> None:
        """Run a command's body: whatever it fails with is shown by the one rule and ends the
        command with that exit status (``typer.Exit``)."""
        try:
            body()
        except typer.Exit:
            raise
        except (Exception, KeyboardInterrupt) as exc:
            if isinstance(exc, KeyboardInterrupt):
                self.hang_up()  # which cancels the daemon's job
            raise typer.Exit(self.fail(exc)) from None

    # -- the daemon -----------------------------------------------------------------------
    def call(self, cmd: str, args: dict[str, Any] | None = None, long: bool = False,
             progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
        """One request to the daemon; ``long`` ones show a progress bar (not under --json),
        or tell ``progress`` how the job goes (a caller that shows one bar for many requests)."""
        if self.client is None:
            self.client = Client(self.socket, daemon_uids=self.daemon_uids)
        try:
            if progress is not None:
                return self.client.call(cmd, args, progress)
            if long and not self.json:
                with self.progress() as update:
                    return self.client.call(cmd, args, update)
            return self.client.call(cmd, args)
        finally:
            if not self.keep_open:
                self.hang_up()

    def hang_up(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
