"""What the commands share: the typer app they are registered on (``lmctl/cli.py`` registers
them, in the order help lists them), the shape of a request to the daemon, the output options."""

import time
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import typer

from ..completion import complete_values
from ..group import HELP_OPTIONS, Lmctl
from ..terminal import ExitStatus, Terminal, human

#: how a command shows its result to a person (under ``--json`` the result is printed as is)
Show = Callable[[Terminal, dict[str, Any]], None]


app = typer.Typer(cls=Lmctl, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Operate an lmctl KV-cache store through its daemon (lmctl serve).",
                  context_settings={"help_option_names": HELP_OPTIONS})



def request(ctx: typer.Context, cmd: str, args: Mapping[str, Any] | Callable[[], dict[str, Any]], show: Show, *,
            long: bool = False, ok: Callable[[dict[str, Any]], bool] | None = None) -> None:
    """One request to the daemon, its result shown (or printed as JSON). ``args`` may be a
    function, when making them can fail; where ``ok`` says a result is no success, the
    command exits with status ERROR once it is shown."""
    term = Terminal.of(ctx)

    def body() -> None:
        r = term.call(cmd, args() if callable(args) else dict(args), long=long)
        term.emit(r, show)
        if ok is not None and not ok(r):
            raise typer.Exit(ExitStatus.ERROR)

    term.run(body)


def mutate(ctx: typer.Context, cmd: str, args: dict[str, Any], dry_run: bool,
           line: Callable[[dict[str, Any]], str], long: bool = False) -> None:
    """A command that changes the store (or, with ``--dry-run``, says what it would change)."""
    request(ctx, cmd, {**args, "dry_run": dry_run}, lambda term, r: term.say(line(r)), long=long)


def chunk_id(key_hex: str) -> str:
    """The part of a key that tells chunks apart: its chunk hash (the first 32 hex digits
    are the namespace, the same for every chunk of a model and adapter). ``--key`` takes
    it back: a start of the chunk hash names the chunk."""
    return key_hex[32:48] + "…"


def write_amplification(r: dict[str, Any]) -> str:
    """Bytes written per payload byte, or - while nothing was written."""
    return f"{r['write_amplification']:.4f}" if r["counters"].get("payload_bytes") else "-"


DryRun = Annotated[bool, typer.Option("--dry-run", help="show what would change; change nothing")]
#: how a listing is printed (``-o``): see ``_formats``
OUTPUTS = ("wide", "tsv", "name")
Output = Annotated[str | None, typer.Option(
    "-o", "--output", help="wide (a table with full keys), tsv (tab-separated values, raw numbers and ISO times, "
                           "a header line first) or name (one full chunk key a line, for --key)",
    autocompletion=complete_values("--output"))]
NoHeaders = Annotated[bool, typer.Option("--no-headers", help="leave out the header line (tables and -o tsv)")]


def formats(ctx: typer.Context, output: str | None, no_headers: bool) -> Terminal:
    """The terminal of a listing, with its ``-o`` and ``--no-headers``."""
    term = Terminal.of(ctx)
    if output is not None and output not in OUTPUTS:
        raise typer.Exit(term.report("usage", f"-o/--output must be wide, tsv or name, not {output!r}"))
    if output is not None and term.json:
        raise typer.Exit(term.report("usage", f"--json and -o {output} are two output formats: give one"))
    term.output, term.no_headers = output, no_headers
    return term


def iso_time(t: float) -> str:
    """A time for scripts: ISO 8601, local, with its offset (2026-12-01T10:32:05+0100)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))


def keys_only(term: Terminal, keys: list[str | None]) -> None:
    """``-o name``: one full chunk key a line (what ``--key`` takes back)."""
    shown = [k for k in keys if k]
    if shown:
        term.echo("\n".join(shown))


Partial = Annotated[bool, typer.Option(
    "--partial", help="when the selection exceeds the tier's room, bring in what fits, in order (else refused)")]


def local_time(t: float) -> str:
    """A time for people: local, with its time zone (a log read on another host stays clear)."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t))


def in_tier_now(r: dict[str, Any]) -> str:
    """What a move or warm into a local tier left there: the selection's chunks in the tier at
    the end (what eviction may have pushed out again shows here), and what --partial left."""
    if r.get("in_tier") is None:
        return ""
    return ((f"; --partial left {r['left']} chunk(s) where they were (over {human(r['room'])} of room)"
             if r["left"] else "")
            + f"; {r['in_tier']} chunk(s) of the selection {'would be' if r['dry_run'] else 'are'} in {r['to']}"
            + (" then" if r["dry_run"] else " now"))


def tiers_table(term: Terminal, tiers: dict[str, Any]) -> None:
    """The tiers: chunks, bytes, capacity, use, pinned bytes (``-o tsv``: raw numbers)."""
    if term.output == "tsv":  # raw numbers
        term.table(None, ["tier", "chunks", "bytes", "disk_bytes", "capacity", "pinned_bytes"],
                   [[name, v["chunks"], v["bytes"], v.get("disk_bytes", v["bytes"]), v["capacity"],
                     v.get("pinned_bytes", 0)] for name, v in tiers.items()])
        return
    rows = []
    for name, v in tiers.items():
        cap = v["capacity"]
        rows.append([name, str(v["chunks"]), human(v["bytes"]), human(cap),
                     f"{100 * v.get('disk_bytes', v['bytes']) / cap:.1f}%" if cap else "-",
                     human(v.get("pinned_bytes", 0))])
    term.table(None, ["tier", "chunks", "bytes", "capacity", "used", "pinned"], rows,
               {"chunks", "bytes", "capacity", "used", "pinned"})
