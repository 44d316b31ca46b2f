"""The lmctl command line.

At this stage the commands open the store directly (``--store DIR`` or
``LMCTL_STORE``); the daemon and its socket come next (docs/cli.md). Nothing here
imports torch or vllm, and the store library is imported only inside commands, so
``lmctl --help`` starts fast.
"""

from __future__ import annotations

import json
import sys
from enum import IntEnum
from typing import Annotated, Any

import typer

from . import __version__


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3


app = typer.Typer(add_completion=False, no_args_is_help=True, help="Operate an lmctl KV-cache store.")
StoreOpt = Annotated[str, typer.Option("--store", envvar="LMCTL_STORE", help="store directory")]
JsonOpt = Annotated[bool, typer.Option("--json", help="machine-readable output")]


def _fail(message: str, code: Exit, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": {"code": int(code), "message": message}}))
    else:
        print(f"lmctl: {message}", file=sys.stderr)
    raise typer.Exit(int(code))


def _open(path: str, as_json: bool) -> Any:
    import os

    from store import Store, StoreError

    if not os.path.isdir(os.path.join(path, "index")):
        _fail(f"no store at {path} (expected {path}/index)", Exit.FAILED, as_json)
    try:
        return Store(path)
    except StoreError as exc:
        _fail(str(exc), Exit.FAILED, as_json)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@app.callback(invoke_without_command=True)
def _main(version: Annotated[bool, typer.Option("--version", help="print the version")] = False) -> None:
    if version:
        print(__version__)
        raise typer.Exit(0)


@app.command()
def inspect(store: StoreOpt, as_json: JsonOpt = False) -> None:
    """Store statistics: tiers, usage, capacity, counters."""
    s = _open(store, as_json)
    try:
        st = s.stats()
    finally:
        s.close()
    if as_json:
        print(json.dumps(st))
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"lmctl store {store}")
    for col in ("tier", "chunks", "bytes", "on disk", "capacity", "pinned", "segments"):
        t.add_column(col, justify="right" if col != "tier" else "left")
    for name, v in st["tiers"].items():
        t.add_row(name, str(v["chunks"]), _human(v["bytes"]), _human(v["disk_bytes"]), _human(v["capacity"]),
                  _human(v["pinned_bytes"]), str(v["segments"]))
    c = Console()
    c.print(t)
    k = st["counters"]
    c.print(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}  "
            f"write amplification {st['write_amplification']:.4f}")


@app.command()
def verify(store: StoreOpt, deep: Annotated[bool, typer.Option(help="read and checksum every payload")] = False,
           fix: Annotated[bool, typer.Option(help="repair what is found")] = False, as_json: JsonOpt = False) -> None:
    """Check index/segment consistency (and checksums with --deep); --fix repairs."""
    s = _open(store, as_json)
    try:
        problems = s.check(fix=fix, deep=deep)
    finally:
        s.close()
    unfixed = [p for p in problems if not p.fixed]
    if as_json:
        print(json.dumps({"problems": [p.__dict__ for p in problems], "ok": not unfixed}))
    else:
        for p in problems:
            print(f"{'fixed' if p.fixed else 'found'}: {p.kind}: {p.detail}")
        print("ok" if not unfixed else f"{len(unfixed)} problem(s) left")
    raise typer.Exit(0 if not unfixed else int(Exit.FAILED))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
