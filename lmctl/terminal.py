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

Human output never prints a control character raw (``printable``): a label or a path
holding one cannot break a table's layout or send escape sequences to the terminal.
A reader that goes away (``lmctl status | head -1``) ends the command with status 0, as
git's do.

Imports neither the store library nor rich at module level: ``lmctl --help`` starts fast.
"""

from __future__ import annotations

import errno
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from enum import IntEnum
from typing import TYPE_CHECKING, Any, Literal, TextIO

import typer

if TYPE_CHECKING:
    from .client import Client


def _console_class() -> Any:
    """rich's Console, except that a closed stdout raises BrokenPipeError for ``Terminal.run``
    (rich itself would exit 1 without a word)."""
    global _CONSOLE
    if _CONSOLE is None:
        from rich.console import Console

        class _Console(Console):
            def on_broken_pipe(self) -> None:
                raise BrokenPipeError(errno.EPIPE, "stdout closed")

        _CONSOLE = _Console
    return _CONSOLE


_CONSOLE: Any = None


class ExitStatus(IntEnum):
    OK = 0
    ERROR = 1  # the operation failed
    USAGE = 2  # a bad or conflicting option, a missing selector, an unknown name
    UNREACHABLE = 3  # no daemon on the socket (or none to trust: another user's)
    UNHEALTHY = 1  # status --check: something needs an operator (the same code as ERROR)
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

    from .client import RemoteError, Unreachable, UntrustedDaemon

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


#: C0 and C1 control characters, DEL, and the bidirectional overrides that reorder what a
#: terminal shows (a label could otherwise hide or fake text in a table)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def printable(text: str) -> str:
    """``text`` with each control character written as its escape (``\\n``, ``\\x1b``)."""
    def esc(m: re.Match[str]) -> str:
        c = m.group()
        return _ESCAPES.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")

    return _CONTROL.sub(esc, text)


def human(n: float) -> str:
    """A byte count for people: 512 B, 1.5 MiB (as ``store.config.human_size`` writes it in the
    store's messages; that module is not imported here, the CLI starts without the store)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
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
    socket: str | None = None  # None: the default (``address``)
    socket_given: bool = False  # --socket or $LMCTL_SOCKET named it (serve then uses it)
    daemon_uids: frozenset[int] | None = None  # --daemon-uid (None: $LMCTL_DAEMON_UID's)
    keep_open: bool = False  # the shell keeps one connection for the whole session
    client: Client | None = None
    err_tty: bool | None = None  # None: ask stderr (where progress and the wait notice go)
    wait_notice_s: float = 1.0  # a request that takes longer says so on a terminal
    line: list[str] = field(default_factory=list)  # the words of the command line being run
    #: the last progress the daemon reported for the running request: (done, total, what)
    last_progress: tuple[int, int, str] | None = None
    quiet: bool = False  # -q/--quiet: data and errors only (no summaries, notices or progress)
    #: ``-o/--output`` of a listing: None (a table), wide (full keys), tsv or name (a key a line)
    output: str | None = None
    no_headers: bool = False  # --no-headers: tables and TSV without their header line

    @property
    def address(self) -> str:
        """The daemon's socket: ``socket``, else $LMCTL_SOCKET, else $LMCTL_STORE's."""
        from .client import default_socket

        return self.socket or default_socket()

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

    @property
    def chatty(self) -> bool:
        """Whether lines for people (summaries, notices, progress) are shown: not under
        ``--quiet``, nor in output meant for scripts (``-o tsv``, ``-o name``)."""
        return not self.quiet and self.output not in ("tsv", "name")

    def say(self, text: str) -> None:
        """A line for people: no markup, control characters escaped (none under ``--quiet``
        or ``-o tsv|name``)."""
        if self.chatty:
            self.console().print(printable(text), markup=False)

    def console(self) -> Any:
        """A rich console on stdout. Lines are never broken inside a value; piped output gets
        room for wide tables."""
        tty = self.is_tty if self.is_tty is not None else self.out.isatty()
        return _console_class()(file=self.stdout, highlight=False, soft_wrap=True, width=None if tty else 200,
                                force_terminal=self.is_tty, color_system=self._color_system())

    def flush(self) -> None:
        """Flush stdout; a reader that went away is no failure (what is left goes nowhere)."""
        try:
            self.out.flush()
        except BrokenPipeError:
            self.silence()

    def silence(self) -> None:
        """Send what stdout still gets to /dev/null: its reader has gone (``| head``), and
        the interpreter's last flush would otherwise fail the exit status."""
        try:
            fd = self.out.fileno()
        except (AttributeError, OSError, ValueError):  # an in-process stream
            return
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, fd)
        finally:
            os.close(devnull)

    def _color_system(self) -> Literal["auto", "standard"] | None:
        return "auto" if self.color is None else "standard" if self.color else None

    def table(self, title: str | None, cols: list[str], rows: list[list[Any]], right: set[str] | None = None) -> None:
        """A table: rich's, or under ``-o tsv`` tab-separated lines (a header line first; a
        value's tabs and newlines escaped). ``--no-headers`` and ``--quiet`` leave the header,
        the title and the borders out."""
        from rich import box
        from rich.table import Table
        from rich.text import Text

        bare = self.no_headers or self.quiet
        if bare and not rows:
            return
        if self.output == "tsv":
            lines = [] if bare else ["\t".join(cols)]
            lines += ["\t".join(printable(c.plain if isinstance(c, Text) else str(c)) for c in r) for r in rows]
            if lines:
                self.echo("\n".join(lines))
            return
        t = Table(title=None if bare else title, show_header=not bare, box=None if bare else box.HEAVY_HEAD,
                  pad_edge=not bare)
        for c in cols:
            t.add_column(c, justify="right" if right and c in right else "left")
        for r in rows:  # a cell is plain text (never markup), unless it is already a rich Text
            t.add_row(*(Text(printable(c)) if isinstance(c, str) else c for c in r))
        self.console().print(t)

    def emit(self, result: dict[str, Any], show: Callable[[Terminal, dict[str, Any]], None]) -> None:
        """A command's result: JSON under ``--json`` (numbers as numbers), else ``show``."""
        if self.json:
            self.echo(json.dumps(result))
        else:
            show(self, result)

    @contextmanager
    def progress(self) -> Iterator[Callable[[int, int, str], None]]:
        """A progress bar on stderr while a long job runs (shown only when stderr is a
        terminal), from the job's first progress report on."""
        bar: Any = None
        task: Any = None

        def update(done: int, total: int, what: str) -> None:
            nonlocal bar, task
            if bar is None:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                console = Console(file=self.stderr, stderr=True, color_system=self._color_system(),
                                  force_terminal=self.err_tty)
                bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                               TimeElapsedColumn(), console=console, transient=True,
                               disable=not console.is_terminal)
                bar.start()
                task = bar.add_task(what or "working", total=total or None)
            bar.update(task, completed=done, total=total or None, description=printable(what) or "working")

        try:
            yield update
        finally:
            if bar is not None:
                bar.stop()

    # -- failures -------------------------------------------------------------------------
    def show_failure(self, failure: Failure) -> int:
        """Print a failure as one line (stderr) or a JSON object (stdout); its exit status."""
        if self.json:
            self.echo(json.dumps({"error": {"code": failure.code, "message": failure.message,
                                            "exit": int(failure.status)}}))
        else:
            print(f"lmctl: {printable(failure.message)}", file=self.err)
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
        except BrokenPipeError:  # stdout's reader went away (the daemon's socket never raises it)
            self.silence()
            raise typer.Exit(ExitStatus.OK) from None
        except KeyboardInterrupt:
            self.hang_up()  # which cancels the daemon's job
            failure = classify(KeyboardInterrupt())
            if self.last_progress is not None:
                done, total, what = self.last_progress
                failure = Failure.of("interrupted", f"interrupted after {done} of {total}" + (
                    f" ({what})" if what else "") + "; the daemon cancels the job (changes made so far stay)")
            raise typer.Exit(self.show_failure(failure)) from None
        except Exception as exc:
            raise typer.Exit(self.fail(exc)) from None

    # -- the daemon -----------------------------------------------------------------------
    def call(self, cmd: str, args: dict[str, Any] | None = None, long: bool = False,
             progress: Callable[[int, int, str], None] | None = None,
             sink: dict[str, list[Any]] | None = None) -> dict[str, Any]:
        """One request to the daemon; ``long`` ones show a progress bar (not under --json),
        or tell ``progress`` how the job goes (a caller that shows one bar for many requests).
        ``sink``: where streamed rows collect as they come (``Client.call``)."""
        if self.client is None:
            from .client import Client

            self.client = Client(self.address, daemon_uids=self.daemon_uids)
        self.last_progress = None
        try:
            # a caller with a bar of its own has it show how the requests go
            with self.waiting(cmd if progress is None else None) as heard, ExitStack() as stack:
                bar = (stack.enter_context(self.progress()) if long and progress is None and not self.json
                       and not self.quiet else None)

                def note(done: int, total: int, what: str) -> None:
                    heard()  # the wait notice goes: a progress bar (or the reply) follows
                    self.last_progress = (done, total, what)
                    if progress is not None:
                        progress(done, total, what)
                    elif bar is not None:
                        bar(done, total, what)

                return self.client.call(cmd, args, note, sink)
        finally:
            if not self.keep_open:
                self.hang_up()

    def _err_is_tty(self) -> bool:
        if self.err_tty is not None:
            return self.err_tty
        try:
            return self.err.isatty()
        except (AttributeError, ValueError):
            return False

    @contextmanager
    def waiting(self, cmd: str | None) -> Iterator[Callable[[], None]]:
        """While a request runs: on a terminal (stderr, not under --json), a line that says
        the CLI waits for the daemon, once it has waited ``wait_notice_s`` (the first lookup
        of a model loads its tokenizer); gone when the reply or a progress report comes.
        Yields what stops it early."""
        if cmd is None or self.json or self.quiet or not self._err_is_tty():
            yield lambda: None
            return
        stop = threading.Event()
        shown = threading.Event()

        def spin() -> None:
            if stop.wait(self.wait_notice_s):
                return
            start = time.monotonic() - self.wait_notice_s
            frames = "|/-\\"
            i = 0
            while not stop.is_set():
                self.err.write(f"\r{frames[i % 4]} lmctl: waiting for the daemon ({cmd}), "
                               f"{time.monotonic() - start:.0f} s; Ctrl-C cancels")
                self.err.flush()
                shown.set()
                i += 1
                stop.wait(0.25)

        t = threading.Thread(target=spin, name="lmctl-wait", daemon=True)
        t.start()

        def done() -> None:
            if not stop.is_set():
                stop.set()
                t.join()
                if shown.is_set():
                    self.err.write("\r\x1b[K")  # erase the line: the reply (or a progress bar) follows
                    self.err.flush()

        try:
            yield done
        finally:
            done()

    def hang_up(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
