"""``lmctl top`` (the live view) and ``lmctl shell`` (the interactive session)."""

import json
import time
from typing import Annotated

import typer

from ..terminal import CommandError, Terminal
from .base import app


def top(ctx: typer.Context, interval: Annotated[float, typer.Option(
            help="seconds between refreshes")] = 1.0,
        iterations: Annotated[int | None, typer.Option(
            help="stop after this many frames, 0 for no limit [default: until q on a terminal, else 1; "
                 "--json: one JSON line per frame]")] = None) -> None:
    """Live view: hit rate, bytes in and out per tier, remote tier, jobs; q quits.

    \b
    Examples:
      lmctl top
      lmctl --json top --interval 10 --iterations 0 >> top.jsonl
    """
    term = Terminal.of(ctx)

    def body() -> None:
        if not 0.1 <= interval <= 3600:
            raise CommandError("usage", f"--interval must be between 0.1 and 3600 seconds, not {interval}")
        if iterations is not None and iterations < 0:
            raise CommandError("usage", f"--iterations must be 0 (no limit) or more, not {iterations}")
        from ..top import rates, run

        if term.json:  # a JSON line per frame (default one), rates over the interval before it
            prev = term.call("metrics")
            frames = 0
            while frames < (iterations if iterations is not None else 1) or iterations == 0:
                time.sleep(interval)
                cur = term.call("metrics")
                term.echo(json.dumps(rates(prev, cur)))
                term.out.flush()  # a line per frame for the reader of a pipe, as it comes
                prev, frames = cur, frames + 1
            return
        live = term.is_tty if term.is_tty is not None else term.out.isatty()
        n = iterations if iterations is not None else (0 if live else 1)
        run(lambda: term.call("metrics"), term.console(), interval, n, live)

    term.run(body)


def shell(ctx: typer.Context) -> None:
    """An interactive session over one connection: history, tab completion, help.

    \b
    Examples:
      lmctl shell
      printf 'status\\nls --limit 5\\n' | lmctl shell
    """
    from ..shell import Shell

    term = Terminal.of(ctx)
    term.keep_open = True
    raise typer.Exit(Shell(app, term).loop())
