"""``lmctl shell``: the same commands as the one-shot CLI, over one daemon connection.

GNU readline gives history (kept in ``~/.lmctl_history``) and tab completion of
commands, their options, and label, adapter and model names fetched from the daemon.
An error prints its one line and the shell carries on.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import typer

from .terminal import ExitStatus, Terminal

HISTORY = os.path.expanduser("~/.lmctl_history")
VALUE_NAMES = {"--label": "labels", "--adapter": "adapters", "--model": "models"}
NOT_IN_SHELL = {"shell", "serve", "completion"}


class Shell:
    def __init__(self, app: typer.Typer, term: Terminal) -> None:
        # the CLI's app is passed in: under ``python -m lmctl.cli`` the CLI module is
        # __main__, and importing it again would make a second app
        self.app = app
        self.term = term
        cmd: Any = typer.main.get_command(app)  # the CLI's root command: it runs a line by the one rule
        self.cmd = cmd
        self.commands: dict[str, Any] = {n: c for n, c in cmd.commands.items() if n not in NOT_IN_SHELL}
        self._names: dict[str, list[str]] | None = None

    # -- completion ------------------------------------------------------------------
    def names(self, refresh: bool = False) -> dict[str, list[str]]:
        if self._names is None or refresh:
            try:
                self._names = self.term.call("names")
            except Exception:
                self._names = {}
        return self._names

    def candidates(self, line: str, text: str) -> list[str]:
        """What may complete ``text``, the last word of ``line`` typed so far."""
        words = shlex.split(line[: len(line) - len(text)]) if line.strip() else []
        if not words:
            return sorted(n for n in [*self.commands, "help", "exit", "quit"] if n.startswith(text))
        cmd = self.commands.get(words[0])
        if cmd is None:
            return []
        if words[-1] in VALUE_NAMES:
            return [n for n in self.names(refresh=True).get(VALUE_NAMES[words[-1]], []) if n.startswith(text)]
        if words[-1] == "--to" or words[-1] == "--tier":
            return [t for t in ("dram", "nvme", "remote") if t.startswith(text)]
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
        return options[state] + " " if state < len(options) else None

    # -- the loop --------------------------------------------------------------------------
    def execute(self, line: str) -> int:
        """Run one line as the CLI would; returns its exit code (errors never end the shell)."""
        try:
            words = shlex.split(line)
        except ValueError as exc:
            return self.term.report("usage", str(exc))
        as_json = "--json" in words  # accepted anywhere on the line, as in the one-shot CLI
        words = [w for w in words if w != "--json"]
        if not words:
            return ExitStatus.OK
        if words[0] in ("help", "?"):
            return self._help(words[1:])
        if words[0] in NOT_IN_SHELL:
            return self.term.report("usage", f"{words[0]} is not available inside the shell")
        if words[0] not in self.commands:
            return self.term.report("usage", f"unknown command {words[0]!r}; type help")
        saved, self.term.json = self.term.json, self.term.json or as_json
        try:
            # the same rule as the one-shot CLI: an error (a bug too) is one line or the JSON
            # error object, never the end of the session
            return int(self.cmd.run_line(words, self.term))
        finally:
            self.term.json = saved

    def _help(self, rest: list[str]) -> int:
        if rest and rest[0] in self.commands:
            return self.execute(f"{shlex.quote(rest[0])} --help")
        self.term.echo("commands: " + ", ".join(sorted(self.commands)))
        self.term.echo("help COMMAND shows its options; Tab completes; exit or Ctrl-D leaves")
        return ExitStatus.OK

    def loop(self) -> None:
        try:
            import readline
        except ImportError:  # pragma: no cover - readline is there on Linux
            readline = None  # type: ignore[assignment]
        if readline is not None:
            try:
                readline.read_history_file(HISTORY)
            except OSError:
                pass
            readline.set_completer_delims(" \t\n\"'")
            readline.set_completer(self._complete)
            readline.parse_and_bind("tab: complete")
        self.term.echo(f"lmctl shell on {self.term.socket}; type help, Tab to complete, exit to leave")
        try:
            while True:
                try:
                    line = input("lmctl> ")
                except EOFError:
                    self.term.echo()
                    break
                except KeyboardInterrupt:
                    self.term.echo()
                    continue
                if line.strip() in ("exit", "quit"):
                    break
                self.execute(line)
                self.term.out.flush()
        finally:
            if readline is not None:
                try:
                    readline.set_history_length(1000)
                    old = os.umask(0o077)  # the history may hold --cache-salt values: owner only
                    try:
                        readline.write_history_file(HISTORY)
                        os.chmod(HISTORY, 0o600)
                    finally:
                        os.umask(old)
                except OSError:
                    pass
            self.term.hang_up()
