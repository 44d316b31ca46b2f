"""The root of the command line: how a line is parsed and run, whatever runs it (``lmctl``
itself, typer's ``CliRunner``, the shell), and what keeps ``lmctl`` quick to start.

* ``Lmctl`` is the root group. A line ends by the one rule of ``lmctl/terminal.py``: option
  errors too are one line (or the JSON error object under ``--json``) with their exit status.
* Start-up: the process builds only the command it runs (``root``); the others are built
  when a help page, completion or the shell asks for them. typer coerces option values with
  pydantic (a ~80 ms import); options of plain types (str, int, float, bool and lists of
  them) are coerced here instead (``_Plain``).
* Help: no metavariable shows a Python type (``--key HEX``, not ``--key <list[str]>``), and
  every command's help ends with where the global options go.
* Repeated options: a single-value option given twice is a usage error, not "the last wins".
"""

from __future__ import annotations

import copy
import inspect
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args, get_origin

import typer
from typer.core import TyperGroup

from .terminal import ExitStatus, Terminal

HELP_OPTIONS = ["-h", "--help"]
#: the options every command accepts, before or after it
GLOBAL_EPILOG = ("Global options, before or after the command: --json prints the result (or the error) as JSON; "
                 "-q/--quiet prints data and errors only; "
                 "--socket PATH names the daemon's socket (default $LMCTL_SOCKET, else $LMCTL_STORE/lmctl.sock).")
#: what a value looks like, by option, where its name alone would not say
METAVARS = {
    "--key": "HEX", "--model": "ID", "--adapter": "NAME[@DIGEST]|PATH", "--label": "LABEL", "--tier": "TIER",
    "--older-than": "DURATION", "--text": "TEXT", "--file": "PATH", "--tokens": "PATH", "--messages": "PATH",
    "--tokenizer": "PATH", "--cache-salt": "SALT", "--cache-salt-file": "PATH", "--store": "DIR",
    "--config": "FILE", "--socket": "PATH", "--allow-uid": "UID", "--socket-mode": "MODE", "--socket-group": "GROUP",
    "--maintenance-interval": "SECONDS", "--capacity": "[TIER=]SIZE", "--tier-path": "TIER=PATH",
    "--pin-budget": "[TIER=]FRACTION|SIZE", "--codec": "CODEC", "--codec-level": "N", "--set": "KEY=VALUE",
    "--log-level": "LEVEL", "--since": "DURATION", "--kind": "KIND", "--limit": "N", "--sort": "ORDER",
    "--cursor": "NEXT", "--level": "N", "--to": "TIER", "--endpoint": "URL", "--interval": "SECONDS",
    "--iterations": "N", "--shell": "SHELL", "-o": "FORMAT",
    "--min-hit": "FRACTION", "--allow-uid-ro": "UID", "--budget": "SIZE", "--deadline": "DURATION",
}


def _command_index(argv: list[str]) -> int:
    """Where the command's name is in ``argv`` (after the global options before it)."""
    i = 0
    while i < len(argv) and argv[i].startswith("-") and argv[i] != "--":
        i += 2 if argv[i] in ("--socket", "--daemon-uid") else 1
    return i


def hoist_globals(argv: list[str]) -> list[str]:
    """Accept the global options after the command too: ``lmctl lookup ... --json``.
    ``serve`` has a ``--socket`` of its own, and ``completion`` prints scripts: after those
    only ``--json`` and ``-q/--quiet`` are global ones."""
    at = _command_index(argv)
    own_socket = at < len(argv) and argv[at] in ("serve", "completion")
    out: list[str] = []
    globals_: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":  # what follows is no option
            out += argv[i:]
            break
        socket_is_global = not (own_socket and i > at)
        if a in ("--json", "-q", "--quiet"):
            globals_.append(a)
        elif a == "--daemon-uid" and i + 1 < len(argv):
            globals_ += [a, argv[i + 1]]
            i += 1
        elif a.startswith("--daemon-uid="):
            globals_.append(a)
        elif a == "--socket" and i + 1 < len(argv) and socket_is_global:
            globals_ += [a, argv[i + 1]]
            i += 1
        elif a.startswith("--socket=") and socket_is_global:
            globals_.append(a)
        else:
            out.append(a)
        i += 1
    return globals_ + out


def _options(args: list[str]) -> list[str]:
    """The words of a command line that may be options (those before ``--``)."""
    return args[: args.index("--")] if "--" in args else args


def _count(words: list[str], flag: str) -> list[str]:
    """The values ``flag`` was given on a command line (``--flag V`` and ``--flag=V``)."""
    out = []
    for i, w in enumerate(words):
        if w == flag:
            out.append(words[i + 1] if i + 1 < len(words) else "")
        elif w.startswith(flag + "="):
            out.append(w[len(flag) + 1:])
    return out


def repeated_option(cmd: Any, words: list[str]) -> str | None:
    """What a command line repeats that the parser would take silently, the last one winning:
    a single-value option given twice, or both forms of an on/off flag."""
    for p in getattr(cmd, "params", []):
        if getattr(p, "param_type_name", "") != "option" or p.multiple or p.nargs == -1:
            continue
        if getattr(p, "is_flag", False):
            if p.secondary_opts and any(o in words for o in p.opts) and any(o in words for o in p.secondary_opts):
                return f"{p.opts[0]} and {p.secondary_opts[0]} contradict each other: give one"
            continue
        given = [v for flag in p.opts for v in _count(words, flag)]
        if len(given) > 1:
            return f"{p.opts[0]} was given {len(given)} times ({', '.join(map(repr, given))}): give it once"
    return None


# -- option values without pydantic ---------------------------------------------------------------
def _whole(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, str)):
        raise ValueError(f"{v!r} is not a whole number")
    try:
        return int(v) if isinstance(v, int) else int(v.strip(), 10)
    except ValueError:
        raise ValueError(f"{v!r} is not a whole number") from None


def _number(v: Any) -> float:
    if isinstance(v, bool):
        raise ValueError(f"{v!r} is not a number")
    try:
        n = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"{v!r} is not a number") from None
    if n != n or n in (float("inf"), float("-inf")):
        raise ValueError(f"{v!r} is not a finite number")
    return n


def _truth(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    text = str(v).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{v!r} is not true or false")


CONVERT: dict[Any, Callable[[Any], Any]] = {str: str, int: _whole, float: _number, bool: _truth}


@dataclass(frozen=True)
class _Plain:
    """typer's coercion of one option (its ``RuntimeParam`` contract: ``coerce``) for a
    plain type, in-range checks included."""

    convert: Callable[[Any], Any]
    low: float | None
    high: float | None

    def one(self, value: Any, param: Any, ctx: Any) -> Any:
        try:
            v = self.convert(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc), ctx=ctx, param=param) from None
        if self.low is not None and v < self.low:
            raise typer.BadParameter(f"must be at least {self.low}, not {v}", ctx=ctx, param=param)
        if self.high is not None and v > self.high:
            raise typer.BadParameter(f"must be at most {self.high}, not {v}", ctx=ctx, param=param)
        return v

    def coerce(self, value: Any, param: Any, ctx: Any) -> Any:
        multi = param.multiple or param.nargs == -1
        if value is None:
            return () if multi else None
        if multi:
            if isinstance(value, str):
                raise typer.BadParameter("Value must be an iterable.", ctx=ctx, param=param)
            return [self.one(v, param, ctx) for v in value]
        return self.one(value, param, ctx)


def _plain_coercion(p: Any) -> None:
    """Coerce ``p``'s values here when its type is plain (typer builds a pydantic adapter
    the first time a value needs one: ``_runtime_param`` None)."""
    desc = getattr(p, "type_descriptor", None)
    if desc is None or getattr(p, "_runtime_param", False) is not None or desc.parameter_info.parser is not None:
        return
    ann = desc.annotation
    if get_origin(ann) is list and len(get_args(ann)) == 1:
        ann = get_args(ann)[0]
    convert = CONVERT.get(ann)
    if convert is not None:
        p._runtime_param = _Plain(convert, getattr(p, "min", None), getattr(p, "max", None))


def _no_type(ctx: Any = None) -> None:
    return None


def prepare(cmd: Any, in_completion: bool = False) -> None:
    """Ready a built command (and a group's commands) for use: plain coercion, metavariables
    without Python types, and where the global options go at the end of its help."""
    from typer._click.core import Context

    # the help option is made when first asked for: made here, it is coerced here too
    help_option = cmd.get_help_option(Context(cmd, help_option_names=HELP_OPTIONS))
    for p in [*cmd.params, *([help_option] if help_option is not None else [])]:
        _plain_coercion(p)
        kind = getattr(p, "param_type_name", "")
        if kind == "option" and not getattr(p, "is_flag", False) and p.metavar is None:
            p.metavar = METAVARS.get(p.opts[0], p.name.upper())
        if kind == "argument" and hasattr(p, "display_type_rich"):
            p.display_type_rich = _no_type  # an argument's metavariable says what it takes
    commands = getattr(cmd, "commands", None)
    if commands is not None:
        for name, sub in commands.items():
            prepare(sub, in_completion or name == "completion")
    elif not in_completion and cmd.name != "help" and GLOBAL_EPILOG not in (cmd.epilog or ""):
        cmd.epilog = f"{cmd.epilog}\n\n{GLOBAL_EPILOG}" if cmd.epilog else GLOBAL_EPILOG


# -- the root ----------------------------------------------------------------------------------------
def _registered(app: typer.Typer) -> dict[str, Any]:
    """The commands and groups ``app`` declares, by name, in their order."""
    out: dict[str, Any] = {}
    for c in app.registered_commands:
        if c.callback is not None:
            out[c.name or typer.main.get_command_name(c.callback.__name__)] = c
    for g in app.registered_groups:
        if isinstance(g.name, str):
            out[g.name] = g
    return out


def _pruned(app: typer.Typer, names: Sequence[str]) -> typer.Typer:
    """``app`` with only the commands and groups named."""
    wanted = [_registered(app)[n] for n in names]
    few = copy.copy(app)
    few.registered_commands = [c for c in app.registered_commands if any(c is w for w in wanted)]
    few.registered_groups = [g for g in app.registered_groups if any(g is w for w in wanted)]
    return few


def root(app: typer.Typer) -> Lmctl:
    """The root command of ``app`` with no command built yet: each is built when first asked
    for (a process that runs ``lmctl status`` builds ``status`` only)."""
    group = typer.main.get_command(_pruned(app, []))
    assert isinstance(group, Lmctl)
    group.source = app
    return group


class Lmctl(TyperGroup):
    """The root command. However a command line is run (``lmctl`` itself, typer's
    ``CliRunner``, the shell) it ends by the rule of ``lmctl/terminal.py``: option errors
    too are one line, or the JSON error object under ``--json``, with their exit status."""

    #: the app whose commands are built on demand (``root``); None when all were built
    source: typer.Typer | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        prepare(self)

    # -- commands built when asked for ------------------------------------------------------------
    def list_commands(self, ctx: Any) -> list[str]:
        return list(_registered(self.source)) if self.source is not None else super().list_commands(ctx)

    def get_command(self, ctx: Any, cmd_name: str) -> Any:
        cmd = self.commands.get(cmd_name)
        if cmd is None and self.source is not None and cmd_name in _registered(self.source):
            built = typer.main.get_command(_pruned(self.source, [cmd_name]))
            cmd = built.commands[cmd_name]  # type: ignore[attr-defined]
            self.commands[cmd_name] = cmd
        return cmd

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        if self.source is None:
            super().format_commands(ctx, formatter)
            return
        # as typer lists them, from each command's summary: the list builds no command
        from typer.core import TyperCommand

        shown = []
        for name, info in _registered(self.source).items():
            cmd = self.commands.get(name)
            if cmd is None:
                text: str | None
                short: str | None = None
                if isinstance(info, typer.models.TyperInfo):
                    text = typer.main.solve_typer_info_help(info)
                else:
                    text = info.help if info.help is not None else inspect.getdoc(info.callback)
                    short = info.short_help
                cmd = TyperCommand(name, help=text or "", short_help=short, hidden=bool(info.hidden))
            if not cmd.hidden:
                shown.append((name, cmd))
        if shown:
            limit = formatter.width - 6 - max(len(n) for n, _ in shown)
            with formatter.section("Commands"):
                formatter.write_dl([(n, c.get_short_help_str(limit)) for n, c in shown])

    def resolve_command(self, ctx: Any, args: list[str]) -> Any:
        from typer import _click as click

        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.UsageError as exc:
            # typer suggests among the commands built; every command is a candidate
            if self.source is not None and args and exc.message.startswith("No such command"):
                import difflib

                close = difflib.get_close_matches(args[0], self.list_commands(ctx))
                exc.message = f"No such command {args[0]!r}." + (
                    f" Did you mean {', '.join(map(repr, close))}?" if close else "")
            raise

    # -- running a line ------------------------------------------------------------------------------
    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
        from . import completion

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode, windows_expand_args, **extra)
        argv = list(sys.argv[1:] if args is None else args)
        if completion.asked():  # a completion script is asking
            completion.init()
            return super().main(argv, completion.PROG, completion.COMPLETE_VAR, **extra)
        argv = hoist_globals(argv)
        obj = extra.get("obj")
        term = obj if isinstance(obj, Terminal) else Terminal()
        term.json = term.json or "--json" in _options(argv)
        try:
            code = self.run_line(argv, term)
        except BrokenPipeError:  # stdout's reader went away (lmctl --help | head -1)
            term.silence()
            code = ExitStatus.OK
        term.flush()
        sys.exit(code)

    def leaf(self, words: list[str]) -> tuple[Any, list[str]]:
        """The command a line runs (a group's subcommand too) and the words after its name."""
        from typer._click.core import Context

        i = _command_index(words)
        cmd: Any = self
        ctx = Context(self, info_name="lmctl", resilient_parsing=True)
        while i < len(words) and hasattr(cmd, "get_command"):
            sub = cmd.get_command(ctx, words[i])
            if sub is None:
                break
            cmd, i = sub, i + 1
        return cmd, words[i:]

    def run_line(self, args: list[str], term: Terminal) -> int:
        """Run one command line in ``term``; its exit status."""
        from typer import _click as click

        from .selectors import contradicting_flags

        problem = contradicting_flags(_options(args))
        cmd, rest = self.leaf(args)
        if problem is None and cmd is not self:
            problem = repeated_option(cmd, _options(rest))
        if problem is None and len(_count(_options(args[: len(args) - len(rest)]), "--socket")) > 1:
            problem = "--socket was given more than once: give it once"
        if problem is not None:
            return term.report("usage", problem)
        term.line = list(args)
        try:
            rv = super().main(args=args, prog_name="lmctl", standalone_mode=False, obj=term)
        except typer.Exit as exc:
            return int(exc.exit_code)
        except SystemExit:
            # typer ends a help page written to a closed stdout with exit 1, once it has
            # wrapped the streams to keep quiet: the reader went away, which is no failure
            if isinstance(sys.stdout, click.utils.PacifyFlushWrapper):
                term.silence()
                return int(ExitStatus.OK)
            raise
        except click.exceptions.NoArgsIsHelpError as exc:  # a group without its command: its help
            return self.missing_command(term, exc.ctx)
        except Exception as exc:  # the parser refused the line (or a bug)
            return term.fail(exc)
        return int(rv) if isinstance(rv, int) else int(ExitStatus.OK)

    @staticmethod
    def missing_command(term: Terminal, ctx: Any) -> int:
        """A line that names no command (``lmctl``, ``lmctl config``): the help of what it
        names, on stdout (under ``--json``, the error object); a usage error."""
        if term.json:
            return term.report("usage", f"give a command: {ctx.command_path} --help lists them")
        term.echo(ctx.get_help())
        return int(ExitStatus.USAGE)
