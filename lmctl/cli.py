"""The lmctl command line: ``lmctl [--socket PATH] [--json] COMMAND ...``.

Each command is a short adapter: its options become one request to the daemon (the work
is done there, by ``lmctl/ops/``) and the result is shown, or printed as JSON. The commands
live in ``lmctl/commands/``, a module per job, and are registered here, in the order help lists
them; what they share lives in a module of its own: the app and the shape of a request
(``commands/base.py``), how a line is parsed and run (``group.py``),
the terminal, exit codes and the one rule from failures to them (``terminal.py``), the
selectors (``selectors.py``), completion (``completion.py``) and ``warm --endpoint``'s
prefill (``prefill.py``).

Nothing here imports torch, vllm or numpy, and the store library is imported by ``serve``
only; a process builds only the command it runs, and a command imports what it needs when
it runs, so ``lmctl`` starts at once (a test keeps heavy imports off the start-up path).
"""

from typing import Annotated

import typer

from . import __version__
from .commands import changes, config, events, install, listing, live, lookup, serve, status, warm
from .commands.base import app
from .group import Lmctl, root
from .terminal import CommandError, ExitStatus, Terminal


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    socket_path: Annotated[str | None, typer.Option(
        "--socket", envvar="LMCTL_SOCKET", help="daemon socket [default: $LMCTL_STORE/lmctl.sock]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output (numbers as numbers)")] = False,
    quiet: Annotated[bool, typer.Option(
        "-q", "--quiet", help="data and errors only: no summaries, notices or progress (the exit status says "
                              "how it went); list commands print their rows alone")] = False,
    daemon_uid: Annotated[str | None, typer.Option(
        "--daemon-uid", envvar="LMCTL_DAEMON_UID", metavar="UID[,UID...]",
        help="also trust a daemon run by this uid or user (the CLI refuses any other but yours and root's)")] = None,
    version: Annotated[bool, typer.Option("--version", help="print the version and exit")] = False,
) -> None:
    term = ctx.obj if isinstance(ctx.obj, Terminal) else Terminal()
    if version:
        term.echo(__version__)
        raise typer.Exit(ExitStatus.OK)
    if socket_path:
        term.socket = socket_path
        term.socket_given = True
    if daemon_uid is not None:
        from .client import parse_daemon_uids

        try:
            term.daemon_uids = frozenset(parse_daemon_uids(daemon_uid))
        except ValueError as exc:
            raise CommandError("usage", str(exc)) from None
    term.json = term.json or as_json
    term.quiet = term.quiet or quiet
    ctx.obj = term
    if ctx.invoked_subcommand is None:  # only global options (lmctl --json)
        raise typer.Exit(Lmctl.missing_command(term, ctx))


def main(argv: list[str] | None = None) -> None:
    """The ``lmctl`` program (``argv``: its arguments, else the process's)."""
    root(app).main(args=argv, prog_name="lmctl")


# -- help -----------------------------------------------------------------------------------------
def help_(ctx: typer.Context, command: Annotated[list[str] | None, typer.Argument(
        metavar="COMMAND", help="the command (and subcommand) whose help to show")] = None) -> None:
    """Show the help of lmctl or of one command (lmctl help config set = lmctl config set --help).

    \b
    Examples:
      lmctl help
      lmctl help config set
    """
    term = Terminal.of(ctx)

    def body() -> None:
        root_ctx = ctx.find_root()
        target, where = root_ctx.command, root_ctx
        for word in command or []:
            sub = target.get_command(where, word) if hasattr(target, "get_command") else None
            if sub is None:
                name = " ".join([*where.command_path.split()[1:], word])
                raise CommandError("usage", f"no command {name!r}: {where.command_path} --help lists the commands")
            where = typer.Context(sub, info_name=word, parent=where)
            target = sub
        term.echo(target.get_help(where))

    term.run(body)


#: the commands, in the order help lists them (the groups after them)
for _name, _command in (
        ("serve", serve.serve), ("status", status.status), ("lookup", lookup.lookup), ("events", events.events),
        ("pin", changes.pin), ("unpin", changes.unpin), ("evict", changes.evict), ("move", changes.move),
        ("compress", changes.compress), ("inspect", listing.inspect_), ("ls", listing.ls_), ("warm", warm.warm),
        ("drain", warm.drain), ("verify", status.verify), ("top", live.top), ("shell", live.shell),
        ("help", help_)):
    app.command(_name)(_command)
app.add_typer(install.completion_app, name="completion")
app.add_typer(install.remote_app, name="remote")
app.add_typer(config.config_app, name="config")


if __name__ == "__main__":
    main()
