"""``lmctl shell``: the same commands as the one-shot CLI, over one daemon connection.

On a terminal, GNU readline gives history (kept in ``~/.lmctl_history``, with cache salts
written as ``***``) and tab completion of commands, subcommands, options, the values an
option takes (sort orders, event kinds, tiers, setting keys, file names) and label,
adapter and model names fetched from the daemon. The prompt says ``not connected>`` while
no daemon answers. An error prints its one line and the shell carries on.

Fed a script (stdin not a terminal), it prints no banner and no prompts, and exits with
the status of the first line that failed (0 when none did).
"""

from __future__ import annotations

import glob
import os
import shlex
from collections.abc import Callable
from typing import Any

import typer

from .completion import FILE_OPTIONS, VALUES
from .terminal import ExitStatus, Terminal

HISTORY = os.path.expanduser("~/.lmctl_history")
VALUE_NAMES = {"--label": "labels", "--adapter": "adapters", "--model": "models"}
NOT_IN_SHELL = {"shell", "serve", "completion"}
#: options whose value is a secret: the history keeps the option, not the value
SECRET_OPTIONS = ("--cache-salt",)


def redact(line: str) -> str | None:
    """``line`` as the history keeps it: the values of ``SECRET_OPTIONS`` written as ``***``
    (None: it cannot be parsed, and names a secret option, so it is not kept at all)."""
    if not any(o in line for o in SECRET_OPTIONS):
        return line
    try:
        words = shlex.split(line)
    except ValueError:
        return None
    out = []
    hide = False
    for w in words:
        if hide:
            out.append("***")
            hide = False
        elif w in SECRET_OPTIONS:
            out.append(w)
            hide = True
        elif w.startswith(tuple(o + "=" for o in SECRET_OPTIONS)):
            out.append(w.partition("=")[0] + "=***")
        else:
            out.append(w)
    return shlex.join(out)


class Shell:
    def __init__(self, app: typer.Typer, term: Terminal, interactive: bool | None = None,
                 read: Callable[[str], str] = input) -> None:
        # the CLI's app is passed in: under ``python -m lmctl.cli`` the CLI module is
        # __main__, and importing it again would make a second app
        self.app = app
        self.term = term
        cmd: Any = typer.main.get_command(app)  # the CLI's root command: it runs a line by the one rule
        self.cmd = cmd
        self.commands: dict[str, Any] = {n: c for n, c in cmd.commands.items() if n not in NOT_IN_SHELL}
        self._names: dict[str, list[str]] | None = None
        self.interactive = interactive
        self.read = read
        self.connected = False

    # -- completion ------------------------------------------------------------------
    def names(self, refresh: bool = False) -> dict[str, list[str]]:
        if self._names is None or refresh:
            try:
                self._names = self.term.call("names")
            except Exception:
                self._names = {}
        return self._names

    def probe(self) -> bool:
        """Whether a daemon answers on the socket now (the names come with the answer)."""
        try:
            self._names = self.term.call("names")
            self.connected = True
        except Exception:
            self.connected = False
        return self.connected

    @staticmethod
    def _option(cmd: Any, word: str) -> Any:
        """The option ``word`` names in ``cmd``, if it takes a value."""
        for p in getattr(cmd, "params", []):
            if getattr(p, "param_type_name", "") == "option" and word in p.opts and not getattr(p, "is_flag", False):
                return p
        return None

    @staticmethod
    def files(text: str) -> list[str]:
        """File and folder names that complete ``text`` (folders end with a slash)."""
        found = sorted(glob.glob(os.path.expanduser(text) + "*"))
        out = [f + "/" if os.path.isdir(f) else f for f in found]
        return [text + f[len(os.path.expanduser(text)):] for f in out] if text.startswith("~") else out

    def candidates(self, line: str, text: str) -> list[str]:
        """What may complete ``text``, the last word of ``line`` typed so far."""
        words = shlex.split(line[: len(line) - len(text)]) if line.strip() else []
        if not words:
            return sorted(n for n in [*self.commands, "help", "exit", "quit"] if n.startswith(text))
        if words[0] in ("help", "?"):
            return sorted(n for n in self.commands if n.startswith(text)) if len(words) == 1 else []
        cmd = self.commands.get(words[0])
        if cmd is None:
            return []
        name = words[0]
        rest = words[1:]
        while hasattr(cmd, "commands"):  # a group: its subcommands
            if not rest:
                return sorted(n for n in cmd.commands if n.startswith(text))
            sub = cmd.commands.get(rest[0])
            if sub is None:
                return []
            cmd, name, rest = sub, f"{name} {rest[0]}", rest[1:]
        last = words[-1]
        if self._option(cmd, last) is not None:  # a value goes here, not an option
            if last in VALUE_NAMES:
                return [n for n in self.names(refresh=True).get(VALUE_NAMES[last], []) if n.startswith(text)]
            values = VALUES.get(f"{words[0]} {last}", VALUES.get(last))
            if values is not None:
                return [v for v in values if v.startswith(text)]
            return self.files(text) if last in FILE_OPTIONS else []
        if not text.startswith("-"):
            args = [p for p in cmd.params if getattr(p, "param_type_name", "") == "argument"]
            if args and args[0].metavar in VALUES:
                return [v for v in VALUES[args[0].metavar] if v.startswith(text)]
        opts = []
        for p in cmd.params:
            if getattr(p, "param_type_name", "") == "option":
                opts.extend(list(p.opts) + list(p.secondary_opts))
        return sorted(o for o in opts if o.startswith(text))

    def _complete(self, text: str, state: int) -> str | None:
        import readline

        try:
            options = self.candidates(readline.get_line_buffer()[: readline.get_endidx()], text)
        except ValueError:  # an open quote
            options = []
        if state >= len(options):
            return None
        word = options[state]
        return word if word.endswith(("/", "=")) else word + " "  # a folder or a key goes on

    # -- the loop --------------------------------------------------------------------------
    def execute(self, line: str) -> int:
        """Run one line as the CLI would; returns its exit code (errors never end the shell)."""
        try:
            words = shlex.split(line)
        except ValueError as exc:
            return self.term.report("usage", str(exc))
        as_json = "--json" in words  # accepted anywhere on the line, as in the one-shot CLI
        quiet = "-q" in words or "--quiet" in words
        words = [w for w in words if w not in ("--json", "-q", "--quiet")]
        if not words:
            return ExitStatus.OK
        if words[0] in ("help", "?") and not words[1:]:
            self.term.echo("commands: " + ", ".join(sorted(self.commands)))
            self.term.echo("help COMMAND [SUBCOMMAND] shows its options; Tab completes; exit or Ctrl-D leaves")
            return ExitStatus.OK
        if words[0] == "?":
            words[0] = "help"
        elif words[0] in NOT_IN_SHELL:
            return self.term.report("usage", f"{words[0]} is not available inside the shell")
        elif words[0] not in self.commands:
            return self.term.report("usage", f"unknown command {words[0]!r}; type help")
        saved = (self.term.json, self.term.quiet, self.term.output, self.term.no_headers)
        self.term.json, self.term.quiet = self.term.json or as_json, self.term.quiet or quiet
        try:
            # the same rule as the one-shot CLI: an error (a bug too) is one line or the JSON
            # error object, never the end of the session
            code = int(self.cmd.run_line(words, self.term))
        finally:
            # a line's output options are its own
            self.term.json, self.term.quiet, self.term.output, self.term.no_headers = saved
        if code == ExitStatus.UNREACHABLE:
            self.connected = False
        elif self.term.client is not None:
            self.connected = True
        return code

    def _remember(self, readline: Any, line: str) -> None:
        """Keep ``line`` in the history with its secrets written as ``***``."""
        kept = redact(line)
        if kept == line:
            return
        n = readline.get_current_history_length()
        if n:
            readline.remove_history_item(n - 1)  # what input() added, as typed
        if kept:
            readline.add_history(kept)

    def loop(self) -> int:
        """Read and run lines until exit or the end of input; the exit status (see the module)."""
        import sys

        interactive = self.interactive if self.interactive is not None else sys.stdin.isatty()
        readline: Any = None
        if interactive:
            try:
                import readline
            except ImportError:  # pragma: no cover - readline is there on Linux
                readline = None
        if readline is not None:
            try:
                readline.read_history_file(HISTORY)
            except OSError:
                pass
            kept = [readline.get_history_item(i) for i in range(1, readline.get_current_history_length() + 1)]
            if any(redact(x) != x for x in kept if x is not None):  # secrets kept by an older lmctl
                readline.clear_history()
                for x in kept:
                    if x is not None and redact(x):
                        readline.add_history(redact(x))
            readline.set_completer_delims(" \t\n\"'")
            readline.set_completer(self._complete)
            readline.parse_and_bind("tab: complete")
        self.probe()
        if interactive:
            self.term.echo(f"lmctl shell on {self.term.address}; type help, Tab to complete, exit to leave")
            if not self.connected:
                self.term.echo(f"no daemon answers on {self.term.address} yet: commands fail until one does "
                               "(lmctl serve --store DIR)")
        status = int(ExitStatus.OK)
        try:
            while True:
                if interactive and not self.connected:
                    self.probe()
                try:
                    line = self.read(("lmctl> " if self.connected else "not connected> ") if interactive else "")
                except EOFError:
                    if interactive:
                        self.term.echo()
                    break
                except KeyboardInterrupt:
                    self.term.echo()
                    continue
                if readline is not None:
                    self._remember(readline, line)
                if line.strip() in ("exit", "quit"):
                    break
                code = self.execute(line)
                if code != ExitStatus.OK and status == ExitStatus.OK and not interactive:
                    status = code
                self.term.flush()
        finally:
            if readline is not None:
                try:
                    readline.set_history_length(1000)
                    old_mask = os.umask(0o077)  # owner only, whatever it holds
                    try:
                        readline.write_history_file(HISTORY)
                        os.chmod(HISTORY, 0o600)
                    finally:
                        os.umask(old_mask)
                except OSError:
                    pass
            self.term.hang_up()
        return status
