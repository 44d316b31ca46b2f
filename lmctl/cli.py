"""The lmctl command line: ``lmctl [--socket PATH] [--json] COMMAND ...``.

Each command is a short adapter: its options become one request to the daemon (the work
is done there, by ``lmctl/ops.py``) and the result is shown, or printed as JSON. What the
commands share lives in a module of its own: the terminal, exit codes and the one rule
from failures to them (``terminal.py``), the selectors (``selectors.py``), completion
scripts (``completion.py``) and ``warm --endpoint``'s prefill (``prefill.py``).

Nothing here imports torch, vllm or numpy, and the store library is imported by ``serve``
only, so ``lmctl --help`` starts fast.
"""

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from . import __version__, completion
from .manifest import export, warm_manifest
from .prefill import prefill
from .selectors import contradicting_flags, with_selectors
from .terminal import CommandError, ExitStatus, Terminal, human

#: how a command shows its result to a person (under ``--json`` the result is printed as is)
Show = Callable[[Terminal, dict[str, Any]], None]


def hoist_globals(argv: list[str]) -> list[str]:
    """Accept the global options after the command too: ``lmctl lookup ... --json``.
    (``serve`` has its own ``--socket``.)"""
    first = next((a for a in argv if not a.startswith("-")), None)
    if first in ("serve", "completion"):
        return argv
    out: list[str] = []
    globals_: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--json":
            globals_.append(a)
        elif a == "--socket" and i + 1 < len(argv):
            globals_ += [a, argv[i + 1]]
            i += 1
        elif a.startswith("--socket="):
            globals_.append(a)
        else:
            out.append(a)
        i += 1
    return globals_ + out


def _options(args: list[str]) -> list[str]:
    """The words of a command line that may be options (those before ``--``)."""
    return args[: args.index("--")] if "--" in args else args


class Lmctl(TyperGroup):
    """The root command. However a command line is run (``lmctl`` itself, typer's
    ``CliRunner``, the shell) it ends by the rule of ``lmctl/terminal.py``: option errors
    too are one line, or the JSON error object under ``--json``, with their exit status."""

    def main(self, args: Sequence[str] | None = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, windows_expand_args: bool = True, **extra: Any) -> Any:
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
        sys.exit(self.run_line(argv, term))

    def run_line(self, args: list[str], term: Terminal) -> int:
        """Run one command line in ``term``; its exit status."""
        problem = contradicting_flags(_options(args))
        if problem is not None:
            return term.report("usage", problem)
        try:
            rv = super().main(args=args, prog_name="lmctl", standalone_mode=False, obj=term)
        except typer.Exit as exc:
            return int(exc.exit_code)
        except Exception as exc:  # the parser refused the line (or a bug)
            return term.fail(exc)
        return int(rv) if isinstance(rv, int) else int(ExitStatus.OK)


app = typer.Typer(cls=Lmctl, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Operate an lmctl KV-cache store through its daemon (lmctl serve).",
                  context_settings={"help_option_names": ["-h", "--help"]})


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    socket_path: Annotated[str | None, typer.Option(
        "--socket", envvar="LMCTL_SOCKET", help="daemon socket [default: $LMCTL_STORE/lmctl.sock]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output (numbers as numbers)")] = False,
    version: Annotated[bool, typer.Option("--version", help="print the version and exit")] = False,
) -> None:
    term = ctx.obj if isinstance(ctx.obj, Terminal) else Terminal()
    if version:
        term.echo(__version__)
        raise typer.Exit(ExitStatus.OK)
    if socket_path:
        term.socket = socket_path
        term.socket_given = True
    term.json = term.json or as_json
    ctx.obj = term


def main(argv: list[str] | None = None) -> None:
    """The ``lmctl`` program (``argv``: its arguments, else the process's)."""
    typer.main.get_command(app).main(args=argv, prog_name="lmctl")


# -- the shape of a command ----------------------------------------------------------------
def _request(ctx: typer.Context, cmd: str, args: Mapping[str, Any] | Callable[[], dict[str, Any]], show: Show, *,
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


def _mutate(ctx: typer.Context, cmd: str, args: dict[str, Any], dry_run: bool,
            line: Callable[[dict[str, Any]], str], long: bool = False) -> None:
    """A command that changes the store (or, with ``--dry-run``, says what it would change)."""
    _request(ctx, cmd, {**args, "dry_run": dry_run}, lambda term, r: term.console().print(line(r)), long=long)


def chunk_id(key_hex: str) -> str:
    """The part of a key that tells chunks apart: its chunk hash (the first 32 hex digits
    are the namespace, the same for every chunk of a model and adapter)."""
    return key_hex[32:48] + "…"


DryRun = Annotated[bool, typer.Option("--dry-run", help="show what would change; change nothing")]


# -- serve ------------------------------------------------------------------------------------
@contextmanager
def _daemon_errors() -> Iterator[None]:
    """The daemon's errors as the CLI's: a ``UsageError`` is a usage error, any other
    ``StoreError`` a failure."""
    from store import StoreError

    from .errors import UsageError

    try:
        yield
    except UsageError as exc:
        raise CommandError("usage", str(exc)) from None
    except StoreError as exc:
        raise CommandError("failed", str(exc)) from None


@app.command()
def serve(
    ctx: typer.Context,
    store: Annotated[str | None, typer.Option(envvar="LMCTL_STORE", help="store folder")] = None,
    init: Annotated[bool, typer.Option("--init", help="create the store if the folder holds none")] = False,
    config: Annotated[str | None, typer.Option(help="TOML config file ([daemon], [store], [tiers.NAME])")] = None,
    socket_path: Annotated[str | None, typer.Option(
        "--socket", help="socket path [default: STORE/lmctl.sock]")] = None,
    allow_uid: Annotated[list[int] | None, typer.Option(
        help="also accept clients of this uid; repeatable (the socket must be reachable: see --socket-mode)")] = None,
    socket_mode: Annotated[str | None, typer.Option(
        help="the socket's mode, octal; 0660 with --socket-group shares it with a group [default: 0600]")] = None,
    socket_group: Annotated[str | None, typer.Option(help="the socket's group: a group name or gid")] = None,
    maintenance_interval: Annotated[float | None, typer.Option(
        help="seconds between background evict/compact runs [default: 30]")] = None,
    capacity: Annotated[list[str] | None, typer.Option(
        help="a tier's capacity, TIER=SIZE (or SIZE for the default tier); repeatable")] = None,
    tier_path: Annotated[list[str] | None, typer.Option(
        help="a tier's folder, TIER=PATH (e.g. dram=/dev/shm/lmctl); repeatable")] = None,
    pin_budget: Annotated[list[str] | None, typer.Option(
        help="a tier's pin budget, TIER=FRACTION or TIER=SIZE; repeatable")] = None,
    codec: Annotated[str | None, typer.Option(help="codec for new chunks: raw, zstd or zstd-shuffle")] = None,
    codec_level: Annotated[int | None, typer.Option(help="zstd level for new chunks, 1-19")] = None,
    remote: Annotated[str | None, typer.Option(
        metavar="URL", help="the shared remote tier: redis://HOST:PORT/DB, rediss://... or unix:///PATH")] = None,
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="any store setting, KEY=VALUE (see lmctl config show); repeatable")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error [default: info]")] = None,
    metrics: Annotated[str | None, typer.Option(
        metavar="[ADDR:]PORT", help="serve Prometheus metrics over HTTP here (a bare port: loopback only)")] = None,
) -> None:
    """Run the daemon in the foreground (logs to stderr; SIGTERM or Ctrl-C stops it)."""
    import logging

    from .daemon import Daemon, socket_access
    from .settings import check_id, serve_settings
    from .settings import maintenance_interval as check_interval

    term = Terminal.of(ctx)

    def body() -> None:
        with _daemon_errors():
            daemon, changes = serve_settings(config, capacity=capacity, tier_path=tier_path, pin_budget=pin_budget,
                                             codec=codec, codec_level=codec_level, remote=remote, settings=set_)
            store_dir = store or daemon.get("store")
            if not store_dir:
                raise CommandError("usage", "give --store DIR (or $LMCTL_STORE, or store in the config file's "
                                            "[daemon])")
            # the socket: serve's --socket, else the global --socket / $LMCTL_SOCKET, else the file's
            sock = socket_path or (term.socket if term.socket_given or os.environ.get("LMCTL_SOCKET") else None)
            sock = sock or daemon.get("socket")
            level = (log_level or daemon.get("log_level") or "info").upper()
            if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
                raise CommandError("usage", f"--log-level must be debug, info, warning or error, not {level.lower()!r}")
            interval = check_interval(maintenance_interval if maintenance_interval is not None else daemon.get(
                "maintenance_interval", 30))
            uids = [check_id(u, "--allow-uid") for u in allow_uid or daemon.get("allow_uid") or []]
            mode, gid = socket_access(socket_mode or daemon.get("socket_mode") or "0600",
                                      socket_group or daemon.get("socket_group"))
            logging.basicConfig(stream=term.err, level=getattr(logging, level),
                                format="%(asctime)s lmctl[%(process)d] %(levelname)s %(message)s")
            listen = metrics or daemon.get("metrics")
            clean = Daemon(store_dir, sock, uids, interval, socket_mode=mode, socket_group=gid, init=init,
                           settings=changes, metrics=None if listen is None else str(listen)).serve()
        raise typer.Exit(ExitStatus.OK if clean else ExitStatus.ERROR)

    term.run(body)


# -- requests to the daemon ---------------------------------------------------------------------
@app.command()
def status(ctx: typer.Context) -> None:
    """Daemon and store health: tiers, usage, capacity, running jobs."""
    _request(ctx, "status", {}, _show_status)


def _show_status(term: Terminal, r: dict[str, Any]) -> None:
    d = r["daemon"]
    c = term.console()
    c.print(f"lmctl {d['version']} serving [bold]{r['store']['path']}[/bold] on {d['socket']} "
            f"(pid {d['pid']}, up {d['uptime_s']:.0f} s, {d['clients']} client(s))")
    _tiers(term, r["store"]["tiers"])
    k = r["store"]["counters"]
    c.print(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}  "
            f"write amplification {r['store']['write_amplification']:.4f}")
    rm = r["store"].get("remote")
    if rm:
        c.print(f"remote {rm['url']} (prefix {rm['key_prefix']}, write {rm['write']}): breaker {rm['breaker']}  "
                f"puts {rm['puts']}  hits {rm['hits']}  misses {rm['misses']}  errors {rm['errors']}  "
                f"evicted found {rm['evicted_discovered']}  (this daemon's calls)")
    for j in r["jobs"]:
        c.print(f"job {j['id']}: {j['cmd']} {j['what']} {j['done']}/{j['total']}")


def _tiers(term: Terminal, tiers: dict[str, Any]) -> None:
    rows = []
    for name, v in tiers.items():
        cap = v["capacity"]
        rows.append([name, str(v["chunks"]), human(v["bytes"]), human(cap),
                     f"{100 * v.get('disk_bytes', v['bytes']) / cap:.1f}%" if cap else "-",
                     human(v.get("pinned_bytes", 0))])
    term.table(None, ["tier", "chunks", "bytes", "capacity", "used", "pinned"], rows,
               {"chunks", "bytes", "capacity", "used", "pinned"})


@app.command()
@with_selectors
def lookup(ctx: typer.Context, sel: dict[str, Any], explain: Annotated[bool, typer.Option(
        "--explain", help="say why the first missing chunk misses (a reason code and a sentence)")] = False) -> None:
    """How much of a document is cached: hit tokens, chunks per tier, first miss (--explain: why)."""
    _request(ctx, "lookup", {**sel, "explain": True} if explain else sel, _show_lookup)


def _show_lookup(term: Terminal, r: dict[str, Any]) -> None:
    c = term.console()
    if r.get("total_tokens"):
        pct = 100 * r["hit_tokens"] / r["total_tokens"]
        c.print(f"{r['hit_tokens']} of {r['total_tokens']} tokens cached ({pct:.0f}%), "
                f"{r['hit_chunks']} of {len(r['chunks'])} full chunks"
                + (f"; first miss at token {r['first_miss']}" if r.get("first_miss") is not None else ""))
    ns = r.get("namespace")
    if ns:
        fp = ns.get("model_fingerprint")
        c.print(f"model {ns.get('model')}  adapter {ns.get('adapter') or '(base)'}"
                + (f"  fingerprint {fp[:12]}" if fp else "") + ("  (salted)" if ns.get("salted") else ""))
    rows = [[str(x["index"]), chunk_id(x["key"]), x["tier"] or "[red]miss[/red]"] for x in r["chunks"]]
    term.table(None, ["chunk", "chunk hash", "tier"], rows)
    if "explain" in r:
        why = r["explain"]
        if why is None:
            tail = r["total_tokens"] - r["hit_tokens"]
            c.print("nothing misses: every full chunk is cached" + (
                f" (the last {tail} token(s) are less than a chunk of {r['chunk_size']}: partial chunks are never "
                "stored, the engine always computes them)" if tail else ""), markup=False)
        else:
            c.print(f"why: {why['reason']}: {why['message']}", markup=False, soft_wrap=True)


@app.command()
def events(ctx: typer.Context, since: Annotated[str | None, typer.Option(
        help="only events of the last 90s, 30m, 1h, 7d ...")] = None,
           kind: Annotated[list[str] | None, typer.Option(
               help="evict, corrupt, save-dropped, pin or unpin; repeatable")] = None,
           limit: Annotated[int, typer.Option(help="the newest N events (0: all)", min=0)] = 50) -> None:
    """The store's bounded event log: evictions, corrupt drops, dropped saves, pins (and totals)."""
    from .units import parse_duration

    def args() -> dict[str, Any]:
        out: dict[str, Any] = {"limit": limit}
        if since is not None:
            try:
                out["since"] = parse_duration(since)
            except ValueError as exc:
                raise CommandError("usage", f"--since: {exc}") from None
        if kind:
            out["kind"] = list(kind)
        return out

    _request(ctx, "events", args, _show_events)


def _show_events(term: Terminal, r: dict[str, Any]) -> None:
    import time

    from rich.markup import escape

    rows = []
    for e in r["events"]:
        what = [f"{k} {e[k]}" for k in ("tier", "label", "uid") if e.get(k) is not None]
        if e.get("bytes"):
            what.append(human(e["bytes"]))
        if e.get("key"):
            what.append(f"first chunk {chunk_id(e['key'])}")
        if e.get("detail"):
            what.append(escape(str(e["detail"])))
        rows.append([time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(e["time"])), e["kind"], e["reason"],
                     str(e["chunks"]), ", ".join(what)])
    term.table(None, ["time", "kind", "reason", "chunks", "details"], rows, {"chunks"})
    totals = [f"{name} {reason}={n}" for name, by in r["counters"].items() for reason, n in sorted(by.items())]
    term.console().print(f"{len(r['events'])} event(s) shown (the log keeps the newest {r['limit']}); totals: "
                         + (", ".join(totals) or "none"), markup=False)


@app.command()
@with_selectors
def pin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False,
        export_manifest: Annotated[str | None, typer.Option(
            metavar="FILE", help="pin nothing: write the documents the selection's pins were made from "
                                 "(typically --label L) to FILE ('-': stdout), for warm --manifest")] = None) -> None:
    """Pin chunks or a document under --label (durable; never evicted). Works before it is served."""
    if export_manifest is not None:
        term = Terminal.of(ctx)
        term.run(lambda: export(term, sel, export_manifest, dry_run))
        return
    _mutate(ctx, "pin", sel, dry_run, lambda r: (
        f"{'would pin' if r['dry_run'] else 'pinned'} {r['chunks']} chunk(s) under {r['label']!r} "
        f"({r['stored']} stored now, {r['added']} new pin reference(s))"))


@app.command()
@with_selectors
def unpin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False) -> None:
    """Remove a label's pins (all of them, or those a selector picks)."""
    _mutate(ctx, "unpin", sel, dry_run, lambda r: (
        f"{'would remove' if r['dry_run'] else 'removed'} {r['removed']} pin reference(s) of {r['label']!r}"))


@app.command()
@with_selectors
def evict(ctx: typer.Context, sel: dict[str, Any], force: Annotated[bool, typer.Option(
        "--force", help="evict pinned chunks too")] = False, dry_run: DryRun = False) -> None:
    """Remove chunks from the store (never pinned ones unless --force)."""
    _mutate(ctx, "evict", {**sel, "force": force}, dry_run, lambda r: (
        f"{'would evict' if r['dry_run'] else 'evicted'} {r['chunks']} chunk(s), {human(r['bytes'])}"
        + (f"; {r['skipped_pinned']} pinned chunk(s) kept" if r["skipped_pinned"] else "")
        + (f"; {r['pinned_removed']} of them pinned ({'would be' if r['dry_run'] else 'were'} removed by --force; "
           "their pins stay and protect them when stored again)" if r["pinned_removed"] else "")), long=True)


@app.command()
@with_selectors
def move(ctx: typer.Context, sel: dict[str, Any], to: Annotated[str, typer.Option(
        help="destination tier: dram, nvme or remote")], dry_run: DryRun = False) -> None:
    """Move chunks to another tier."""
    _mutate(ctx, "move", {**sel, "to": to}, dry_run, lambda r: (
        f"{'would move' if r['dry_run'] else 'moved'} {r['chunks']} chunk(s), {human(r['bytes'])} to {r['to']}"
        + (f" ({r['skipped']} already there)" if r["skipped"] else "")), long=True)


@app.command()
@with_selectors
def compress(ctx: typer.Context, sel: dict[str, Any],
             level: Annotated[int, typer.Option(help="zstd level, 1-19")] = 1,
             codec: Annotated[str, typer.Option(help="zstd-shuffle, zstd or raw")] = "zstd-shuffle",
             dry_run: DryRun = False) -> None:
    """Recompress chunks and report the bytes saved."""
    _mutate(ctx, "compress", {**sel, "level": level, "codec": codec}, dry_run, _compressed, long=True)


def _compressed(r: dict[str, Any]) -> str:
    saved = r["bytes_saved"]
    change = f"saved {human(saved)}" if saved >= 0 else f"grew by {human(-saved)}"
    skipped = f"; {r['skipped']} already {r['codec']} at that level" if r["skipped"] else ""
    if r["dry_run"]:
        return (f"would recompress {r['chunks']} chunk(s): {human(r['bytes_before'])} -> about "
                f"{human(r['bytes_after'])} (estimated), {change}{skipped}")
    return (f"recompressed {r['chunks']} chunk(s): {human(r['bytes_before'])} -> {human(r['bytes_after'])}, "
            f"{change}{skipped}")


@app.command("inspect")
@with_selectors
def inspect_(ctx: typer.Context, sel: dict[str, Any]) -> None:
    """Store statistics by tier, model, adapter and label, or one chunk's metadata (--key K).

    With selectors, the statistics of the chunks they pick."""
    _request(ctx, "inspect", sel, _show_inspect)


def _show_inspect(term: Terminal, r: dict[str, Any]) -> None:
    if "chunk" in r:
        now = time.time()

        def shown(k: str, v: Any) -> str:
            if k in ("created", "last_access") and isinstance(v, (int, float)):
                return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v)) + f" ({ago(now - v)} ago)"
            if v is None:
                return "-"
            return v if isinstance(v, str) else json.dumps(v)

        term.table(None, ["field", "value"], [[k, shown(k, v)] for k, v in r["chunk"].items()])
        return
    c = term.console()
    if "scope" in r:
        c.print(f"selected: {r['chunks']} chunks, {human(r['bytes'])} on disk")
    else:
        c.print(f"{r['chunks']} chunks, {human(r['bytes'])}; write amplification {r['write_amplification']:.4f}")
    _tiers(term, r["tiers"])
    if r["models"]:
        term.table("models (one row per checkpoint fingerprint)",
                   ["model", "fingerprint", "last used", "chunks", "bytes"],
                   [[m["model"], (m["fingerprint"] or "-")[:12] + (" (retired)" if m["retired"] else ""),
                     time.strftime("%Y-%m-%d %H:%M", time.localtime(m["last_used"])) if m["last_used"] else "-",
                     str(m["chunks"]), human(m["bytes"])] for m in r["models"]], {"chunks", "bytes"})
    if r["adapters"]:
        term.table("by model and adapter", ["model", "adapter", "chunks", "bytes"],
                   [[a["model"], a["adapter"] or "(base)", str(a["chunks"]), human(a["bytes"])]
                    for a in r["adapters"]], {"chunks", "bytes"})
    if r["labels"]:
        term.table("labels", ["label", "chunks"], [[k, str(v)] for k, v in r["labels"].items()], {"chunks"})
    k = r["counters"]
    c.print(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}")


@app.command("ls")
@with_selectors
def ls_(ctx: typer.Context, sel: dict[str, Any], limit: Annotated[int, typer.Option(
        help="rows per page (0: all, in key order)", min=0)] = 100,
        sort: Annotated[str, typer.Option(
            help="key, age (oldest first), access (least recently used first) or size (largest first)")] = "key",
        cursor: Annotated[str | None, typer.Option(
            help="continue a listing where the last page ended (its 'next')")] = None) -> None:
    """List chunks matching a selector (all chunks without one), a page at a time."""
    _request(ctx, "ls", {**sel, "limit": limit, "sort": sort, **({"cursor": cursor} if cursor else {})}, _show_ls)


def ago(seconds: float) -> str:
    """A duration the way a listing shows it: 45s, 12m, 3h, 9d."""
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


def _show_ls(term: Terminal, r: dict[str, Any]) -> None:
    now = time.time()
    rows = [[chunk_id(x["key"]), x["tier"], human(x["bytes"]), str(x["tokens"]), str(x["pins"]),
             str(x["hits"]), ago(now - x["created"]), ago(now - x["last_access"]) + " ago",
             x["adapter"] or "(base)"] for x in r["chunks"]]
    term.table(None, ["chunk hash", "tier", "bytes", "tokens", "pins", "hits", "age", "last access", "adapter"],
               rows, {"bytes", "tokens", "pins", "hits", "age", "last access"})
    more = f" (showing {len(r['chunks'])})" if r["truncated"] else ""
    term.console().print(f"{r['total']} chunk(s), {human(r['bytes'])}{more}")
    if r.get("next"):
        term.console().print(f"next page: --cursor {r['next']}", soft_wrap=True)


WARM_KEYS = ("chunks", "bytes", "bytes_before", "bytes_after", "skipped", "missing", "fetched", "dry_run", "to",
             "prefill")


@app.command()
@with_selectors
def warm(ctx: typer.Context, sel: dict[str, Any], endpoint: Annotated[str | None, typer.Option(
        help="also prefill the document through this OpenAI-compatible server (http://host:port)")] = None,
         to: Annotated[str | None, typer.Option(
             help="the local tier to bring chunks into: dram or nvme [default: dram; with --manifest, the "
                  "default tier where there is no dram]")] = None,
         manifest: Annotated[str | None, typer.Option(
             metavar="FILE", help="warm every document of a manifest (pin --export-manifest writes one; "
                                  "'-': stdin)")] = None,
         pin_: Annotated[bool, typer.Option("--pin", help="with --manifest: also pin each entry under its label")]
         = False, dry_run: DryRun = False) -> None:
    """Before a restart or traffic shift: bring chunks (or a manifest's) into dram; --endpoint prefills the rest."""
    term = Terminal.of(ctx)

    def body() -> None:
        if manifest is not None:
            if not warm_manifest(term, manifest, sel, to, endpoint, pin_, dry_run):
                raise typer.Exit(ExitStatus.ERROR)
            return
        if pin_:
            raise CommandError("usage", "--pin goes with --manifest (to pin a document, use lmctl pin)")
        out: dict[str, Any] = {}
        if endpoint:
            out["prefill"] = prefill(term, sel, endpoint, dry_run)
            if to is None and "dram" not in term.call("status")["store"]["tiers"]:
                # prefill only: the chunks stay where the engine wrote them
                out.update({"chunks": 0, "bytes": 0, "bytes_before": 0, "bytes_after": 0, "skipped": 0,
                            "missing": 0, "fetched": 0, "dry_run": dry_run, "to": None})
        if "to" not in out:
            out.update(term.call("warm", {**sel, "dry_run": dry_run, **({"to": to} if to else {})}, long=True))
        term.emit({k: out[k] for k in sorted(out, key=WARM_KEYS.index)}, _show_warm)

    term.run(body)


def _show_warm(term: Terminal, r: dict[str, Any]) -> None:
    c = term.console()
    if "prefill" in r:
        p = r["prefill"]
        c.print(f"prefill: {p['hit_tokens_before']} -> {p['hit_tokens_after']} of {p['total_tokens']} tokens cached")
    if r["to"] is None:
        c.print("no dram tier in this store: the chunks stay where the engine wrote them")
    else:
        c.print(f"{'would promote' if r['dry_run'] else 'promoted'} {r['chunks']} chunk(s), "
                f"{human(r['bytes'])} to {r['to']}"
                + (f" ({r['fetched']} from the remote tier)" if r["fetched"] else "")
                + (f"; {r['missing']} in no tier" if r["missing"] else ""))


@app.command()
def verify(ctx: typer.Context, deep: Annotated[bool, typer.Option(help="read and checksum every payload")] = False,
           fix: Annotated[bool, typer.Option(help="repair what is found")] = False) -> None:
    """Check index/segment consistency (and checksums with --deep); --fix repairs."""
    _request(ctx, "verify", {"deep": deep, "fix": fix}, _show_verify, long=True, ok=lambda r: r["ok"])


def _show_verify(term: Terminal, r: dict[str, Any]) -> None:
    for p in r["problems"]:
        term.echo(f"{'fixed' if p['fixed'] else 'found'}: {p['kind']}: {p['detail']}")
    left = sum(1 for p in r["problems"] if not p["fixed"])
    # what --deep found (bad payloads) only a deep pass can fix
    again = "lmctl verify --deep --fix" if r["deep"] else "lmctl verify --fix"
    term.echo("ok" if not left else f"{left} problem(s) left; run {again}")


@app.command()
def top(ctx: typer.Context, interval: Annotated[float, typer.Option(
            help="seconds between refreshes")] = 1.0,
        iterations: Annotated[int | None, typer.Option(
            help="stop after this many frames, 0 for no limit [default: until q on a terminal, else 1; "
                 "--json: one JSON line per frame]")] = None) -> None:
    """Live view: hit rate, bytes in and out per tier, remote tier, jobs; q quits."""
    term = Terminal.of(ctx)

    def body() -> None:
        if not 0.1 <= interval <= 3600:
            raise CommandError("usage", f"--interval must be between 0.1 and 3600 seconds, not {interval}")
        if iterations is not None and iterations < 0:
            raise CommandError("usage", f"--iterations must be 0 (no limit) or more, not {iterations}")
        from .top import rates, run

        if term.json:  # a JSON line per frame (default one), rates over the interval before it
            prev = term.call("metrics")
            for _ in range(iterations or 1):
                time.sleep(interval)
                cur = term.call("metrics")
                term.echo(json.dumps(rates(prev, cur)))
                prev = cur
            return
        live = term.is_tty if term.is_tty is not None else term.out.isatty()
        n = iterations if iterations is not None else (0 if live else 1)
        run(lambda: term.call("metrics"), term.console(), interval, n, live)

    term.run(body)


@app.command()
def shell(ctx: typer.Context) -> None:
    """An interactive session over one connection: history, tab completion, help."""
    from .shell import Shell

    term = Terminal.of(ctx)
    term.keep_open = True
    Shell(app, term).loop()


# -- completion scripts ---------------------------------------------------------------------
completion_app = typer.Typer(help="Shell completion scripts (bash, zsh, fish).", no_args_is_help=True)
app.add_typer(completion_app, name="completion")


@completion_app.command("show")
def completion_show(ctx: typer.Context, shell_name: Annotated[str, typer.Argument(
        metavar="SHELL", help="bash, zsh or fish")]) -> None:
    """Print the completion script for a shell."""
    term = Terminal.of(ctx).without_json()
    term.run(lambda: term.echo(completion.script(shell_name), end=""))


@completion_app.command("install")
def completion_install(ctx: typer.Context, shell_name: Annotated[str | None, typer.Option(
        "--shell", help="bash, zsh or fish [default: from $SHELL]")] = None) -> None:
    """Install the completion script where the shell finds it (in your home folder)."""
    term = Terminal.of(ctx).without_json()

    def body() -> None:
        for line in completion.install(shell_name, os.path.expanduser("~"), os.environ.get("SHELL", "bash")):
            term.echo(line)

    term.run(body)


# -- settings -----------------------------------------------------------------------------------
config_app = typer.Typer(help="Show or change the store's settings through the daemon.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """The store's settings (tiers, capacities, pin budgets, codec, ...)."""
    _request(ctx, "config", {}, _show_settings)


@config_app.command("set")
def config_set(ctx: typer.Context, pairs: Annotated[list[str], typer.Argument(
        metavar="KEY=VALUE...", help="e.g. tiers.nvme.capacity=500GiB codec=zstd-shuffle")]) -> None:
    """Change store settings (validated, recorded in the store, applied at once)."""
    _request(ctx, "config", lambda: {"set": _changes(pairs)}, _show_settings)


def _changes(pairs: list[str]) -> dict[str, str]:
    changes: dict[str, str] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise CommandError("usage", f"{p!r} is not KEY=VALUE (e.g. tiers.nvme.capacity=500GiB)")
        changes[k.strip()] = v.strip()
    return changes


def _show_settings(term: Terminal, r: dict[str, Any]) -> None:
    cfg = r["settings"]
    rows = [[k, json.dumps(v) if not isinstance(v, str) else v] for k, v in cfg.items() if k != "tiers"]
    for name, t in cfg["tiers"].items():
        rows += [[f"tiers.{name}.{k}", json.dumps(v) if not isinstance(v, str) else v] for k, v in t.items()]
    term.table(None, ["setting", "value"], rows)
    if r.get("changed"):
        term.console().print("changed: " + ", ".join(r["changed"]))


if __name__ == "__main__":
    main()
