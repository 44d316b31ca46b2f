"""The lmctl command line: ``lmctl [--socket PATH] [--json] COMMAND ...``.

Each command is a short adapter: its options become one request to the daemon (the work
is done there, by ``lmctl/ops.py``) and the result is shown, or printed as JSON. What the
commands share lives in a module of its own: how a line is parsed and run (``group.py``),
the terminal, exit codes and the one rule from failures to them (``terminal.py``), the
selectors (``selectors.py``), completion (``completion.py``) and ``warm --endpoint``'s
prefill (``prefill.py``).

Nothing here imports torch, vllm or numpy, and the store library is imported by ``serve``
only; a process builds only the command it runs, and a command imports what it needs when
it runs, so ``lmctl`` starts at once (a test keeps heavy imports off the start-up path).
"""

import json
import os
import shlex
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from . import __version__
from .completion import REMOTE_SETTINGS, STORE_SETTINGS, TIER_SETTINGS, complete_values
from .group import HELP_OPTIONS, Lmctl, root
from .selectors import with_selectors
from .terminal import CommandError, ExitStatus, Terminal, human, printable

#: how a command shows its result to a person (under ``--json`` the result is printed as is)
Show = Callable[[Terminal, dict[str, Any]], None]


app = typer.Typer(cls=Lmctl, add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Operate an lmctl KV-cache store through its daemon (lmctl serve).",
                  context_settings={"help_option_names": HELP_OPTIONS})


@app.callback(invoke_without_command=True)
def _main(
    ctx: typer.Context,
    socket_path: Annotated[str | None, typer.Option(
        "--socket", envvar="LMCTL_SOCKET", help="daemon socket [default: $LMCTL_STORE/lmctl.sock]")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output (numbers as numbers)")] = False,
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
    ctx.obj = term
    if ctx.invoked_subcommand is None:  # only global options (lmctl --json)
        raise typer.Exit(Lmctl.missing_command(term, ctx))


def main(argv: list[str] | None = None) -> None:
    """The ``lmctl`` program (``argv``: its arguments, else the process's)."""
    root(app).main(args=argv, prog_name="lmctl")


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
    _request(ctx, cmd, {**args, "dry_run": dry_run}, lambda term, r: term.say(line(r)), long=long)


def chunk_id(key_hex: str) -> str:
    """The part of a key that tells chunks apart: its chunk hash (the first 32 hex digits
    are the namespace, the same for every chunk of a model and adapter). ``--key`` takes
    it back: a start of the chunk hash names the chunk."""
    return key_hex[32:48] + "…"


def write_amplification(r: dict[str, Any]) -> str:
    """Bytes written per payload byte, or - while nothing was written."""
    return f"{r['write_amplification']:.4f}" if r["counters"].get("payload_bytes") else "-"


DryRun = Annotated[bool, typer.Option("--dry-run", help="show what would change; change nothing")]
Partial = Annotated[bool, typer.Option(
    "--partial", help="when the selection exceeds the tier's room, bring in what fits, in order (else refused)")]


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
        help="a tier's folder, TIER=PATH (e.g. dram=/dev/shm/lmctl-UID/main, a folder of yours); repeatable")] = None,
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
    """Run the daemon in the foreground (logs to stderr; SIGTERM or Ctrl-C stops it).

    \b
    Examples:
      lmctl serve --store /var/lib/lmctl --init --capacity nvme=500GiB
      lmctl serve --store /var/lib/lmctl --config /etc/lmctl.toml --metrics 9464
    """
    import logging

    from .daemon import Daemon, socket_access
    from .settings import check_id, serve_settings
    from .settings import maintenance_interval as check_interval

    term = Terminal.of(ctx)

    def body() -> None:
        for flag, values in (("--capacity", capacity), ("--tier-path", tier_path), ("--pin-budget", pin_budget),
                             ("--set", set_)):
            _once_per_key(flag, values or [], "=" in (values or [""])[0] or flag != "--capacity")
        with _daemon_errors():
            daemon, changes = serve_settings(config, capacity=capacity, tier_path=tier_path, pin_budget=pin_budget,
                                             codec=codec, codec_level=codec_level, remote=remote, settings=set_)
            store_dir = store or daemon.get("store")
            if not store_dir:
                raise CommandError("usage", "give --store DIR (or $LMCTL_STORE, or store in the config file's "
                                            "[daemon])")
            # the socket: serve's --socket, else the global --socket / $LMCTL_SOCKET, else the file's
            sock = socket_path or (term.address if term.socket_given or os.environ.get("LMCTL_SOCKET") else None)
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


def _once_per_key(flag: str, values: list[str], keyed: bool) -> None:
    """Each tier (or setting) once per repeatable KEY=VALUE option: given twice, the parser
    would keep the last without a word."""
    seen: dict[str, str] = {}
    for v in values:
        k = v.partition("=")[0].strip() if "=" in v else ""  # no key: the default tier
        if k in seen:
            what = f"names {'setting' if flag == '--set' else 'tier'} {k}" if k else "gives the default tier"
            raise CommandError("usage", f"{flag} {what} twice ({seen[k]}, {v}): give it once")
        seen[k] = v


# -- requests to the daemon ---------------------------------------------------------------------
@app.command()
def status(ctx: typer.Context) -> None:
    """Daemon and store health: tiers, usage, capacity, running jobs.

    \b
    Examples:
      lmctl status
      lmctl --json status | jq .store.tiers
    """
    _request(ctx, "status", {}, _show_status)


def _show_status(term: Terminal, r: dict[str, Any]) -> None:
    from rich.markup import escape

    d = r["daemon"]
    c = term.console()
    c.print(f"lmctl {d['version']} serving [bold]{escape(printable(r['store']['path']))}[/bold] on "
            f"{escape(printable(d['socket']))} (pid {d['pid']}, up {d['uptime_s']:.0f} s, {d['clients']} client(s))")
    if r["store"].get("readonly"):
        term.say(f"read-only: {r['store']['readonly_reason']}; hits are served, saves refused "
                 f"({r['store'].get('refused_saves', 0)} refused by the daemon; engines count theirs as "
                 "dropped saves, reason read_only)")
    _tiers(term, r["store"]["tiers"])
    k = r["store"]["counters"]
    term.say(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}  "
             f"write amplification {write_amplification(r['store'])}")
    rm = r["store"].get("remote")
    if rm:
        term.say(f"remote {rm['url']} (prefix {rm['key_prefix']}, write {rm['write']}, trust {rm['trust']}"
                 f"{', rotating' if rm['rotating'] else ''}, writer {rm['writer']}): breaker {rm['breaker']}  "
                 f"puts {rm['puts']}  hits {rm['hits']}  misses {rm['misses']}  errors {rm['errors']}  "
                 f"forged {rm['forged']}  foreign {rm['foreign']}  evicted found {rm['evicted_discovered']}  "
                 "(this daemon's calls)")
    if r["store"].get("remote_refused"):
        term.say(f"remote tier not started: {r['store']['remote_refused']}")
    for j in r["jobs"]:
        term.say(f"job {j['id']}: {j['cmd']} {j['what']} {j['done']}/{j['total']}")


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
    """How much of a document is cached: hit tokens, chunks per tier, first miss (--explain: why).

    \b
    Examples:
      lmctl lookup --model smollm2 --messages chat.json --explain
      lmctl lookup --adapter civil --file contract.txt
      lmctl --json lookup --key 48c937a7583e21f2
    """
    _request(ctx, "lookup", {**sel, "explain": True} if explain else sel, _show_lookup)


def _show_lookup(term: Terminal, r: dict[str, Any]) -> None:
    from rich.text import Text

    n, size, total = len(r["chunks"]), r.get("chunk_size"), r.get("total_tokens") or 0
    short = n == 0 and total > 0  # a document shorter than one chunk
    if short:
        term.say(f"the document's {total} token(s) are less than one chunk of {size}: nothing of it is stored "
                 "(partial chunks never are; the engine always computes them)")
    elif total:
        pct = 100 * r["hit_tokens"] / total
        tail = total - n * size if size else 0
        term.say(f"{r['hit_tokens']} of {total} tokens cached ({pct:.0f}%), {r['hit_chunks']} of {n} full chunks"
                 + (f"; first miss at token {r['first_miss']}" if r.get("first_miss") is not None
                    and r["hit_chunks"] < n else "")
                 + (f"; the last {tail} token(s) are less than a chunk (never stored)" if tail > 0 else ""))
    ns = r.get("namespace")
    if ns:
        fp = ns.get("model_fingerprint")
        term.say(f"model {ns.get('model')}  adapter {ns.get('adapter') or '(base)'}"
                 + (f"  fingerprint {fp[:12]}" if fp else "") + ("  (salted)" if ns.get("salted") else ""))
    if n:
        rows = [[str(x["index"]), chunk_id(x["key"]), x["tier"] or Text("miss", style="red")] for x in r["chunks"]]
        term.table(None, ["chunk", "chunk hash", "tier"], rows)
    if "explain" in r and not short:
        why = r["explain"]
        if why is None:
            term.say("nothing misses: every full chunk is cached")
        else:
            term.say(f"why: {why['reason']}: {why['message']}")


@app.command()
def events(ctx: typer.Context, since: Annotated[str | None, typer.Option(
        help="only events of the last DURATION: 90s, 30m, 1h, 7d, 1h30m (a unit is required)")] = None,
           kind: Annotated[list[str] | None, typer.Option(
               help="evict, corrupt, save-dropped, pin or unpin; repeatable",
               autocompletion=complete_values("--kind"))] = None,
           limit: Annotated[int, typer.Option(help="the newest N events (0: all)", min=0)] = 50) -> None:
    """The store's bounded event log: evictions, corrupt drops, dropped saves, pins (and totals).

    \b
    Examples:
      lmctl events --since 1h --kind evict
      lmctl --json events --limit 0 | jq '.events[] | select(.kind == "corrupt")'
    """
    from .units import parse_duration

    def args() -> dict[str, Any]:
        out: dict[str, Any] = {"limit": limit}
        if since is not None:
            try:
                out["since"] = parse_duration(since, unit_required=True)
            except ValueError as exc:
                raise CommandError("usage", f"--since: {exc}") from None
        if kind:
            out["kind"] = list(kind)
        return out

    _request(ctx, "events", args, _show_events)


def local_time(t: float) -> str:
    """A time for people: local, with its time zone (a log read on another host stays clear)."""
    return time.strftime("%Y-%m-%d %H:%M:%S %z", time.localtime(t))


def user(uid: int) -> str:
    """A uid with its user name, where this host knows one: ``1000 (alice)``."""
    import pwd

    try:
        return f"{uid} ({pwd.getpwuid(uid).pw_name})"
    except (KeyError, OverflowError, TypeError):
        return str(uid)


def _show_events(term: Terminal, r: dict[str, Any]) -> None:
    rows = []
    for e in r["events"]:
        what = [f"{k} {e[k]}" for k in ("tier", "label") if e.get(k) is not None]
        if e.get("uid") is not None:
            what.append(f"uid {user(e['uid'])}")
        if e.get("bytes"):
            what.append(human(e["bytes"]))
        if e.get("key"):
            what.append(f"first chunk {chunk_id(e['key'])}")
        if e.get("detail"):
            what.append(str(e["detail"]))
        rows.append([local_time(e["time"]), e["kind"], e["reason"], str(e["chunks"]), ", ".join(what)])
    term.table(None, ["time", "kind", "reason", "chunks", "details"], rows, {"chunks"})
    totals = [f"{name} {reason}={n}" for name, by in r["counters"].items() for reason, n in sorted(by.items())]
    term.say(f"{len(r['events'])} event(s) shown (the log keeps the newest {r['limit']}); totals: "
             + (", ".join(totals) or "none"))


@app.command()
@with_selectors
def pin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False,
        export_manifest: Annotated[str | None, typer.Option(
            metavar="FILE", help="pin nothing: write the documents the selection's pins were made from "
                                 "(typically --label L) to FILE ('-': stdout), for warm --manifest")] = None) -> None:
    """Pin chunks or a document under --label (durable; never evicted). Works before it is served.

    \b
    Examples:
      lmctl pin --label contracts --model smollm2 --messages lease.json
      lmctl pin --label ops --key 48c937a7583e21f2 --dry-run
      lmctl pin --export-manifest contracts.json --label contracts
    """
    if export_manifest is not None:
        from .manifest import export

        term = Terminal.of(ctx)
        term.run(lambda: export(term, sel, export_manifest, dry_run))
        return
    _mutate(ctx, "pin", sel, dry_run, lambda r: (
        f"{'would pin' if r['dry_run'] else 'pinned'} {r['chunks']} chunk(s) under {r['label']!r} "
        f"({r['stored']} stored now, {r['added']} new pin reference(s))"))


@app.command()
@with_selectors
def unpin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False) -> None:
    """Remove a label's pins (all of them, or those a selector picks).

    \b
    Examples:
      lmctl unpin --label contracts --dry-run
      lmctl unpin --label contracts --messages lease.json
    """
    _mutate(ctx, "unpin", sel, dry_run, lambda r: (
        f"{'would remove' if r['dry_run'] else 'removed'} {r['removed']} pin reference(s) of {r['label']!r}"))


@app.command()
@with_selectors
def evict(ctx: typer.Context, sel: dict[str, Any], force: Annotated[bool, typer.Option(
        "--force", help="evict pinned chunks too")] = False, dry_run: DryRun = False) -> None:
    """Remove chunks from the store (never pinned ones unless --force).

    \b
    Examples:
      lmctl evict --older-than 7d --unpinned --dry-run
      lmctl evict --adapter civil@3f9a51c2
    """
    _mutate(ctx, "evict", {**sel, "force": force}, dry_run, lambda r: (
        f"{'would evict' if r['dry_run'] else 'evicted'} {r['chunks']} chunk(s), {human(r['bytes'])}"
        + (f"; {r['skipped_pinned']} pinned chunk(s) kept" if r["skipped_pinned"] else "")
        + (f"; {r['pinned_removed']} of them pinned ({'would be' if r['dry_run'] else 'were'} removed by --force; "
           "their pins stay and protect them when stored again)" if r["pinned_removed"] else "")), long=True)


@app.command()
@with_selectors
def move(ctx: typer.Context, sel: dict[str, Any], to: Annotated[str, typer.Option(
        help="destination tier: dram, nvme or remote", autocompletion=complete_values("--to"))],
         partial: Partial = False, dry_run: DryRun = False) -> None:
    """Move chunks to another tier (refused when the selection exceeds a local tier's room).

    \b
    Examples:
      lmctl move --to dram --label contracts
      lmctl move --to dram --model smollm2 --partial
      lmctl move --to remote --base --older-than 1d --dry-run
    """
    _mutate(ctx, "move", {**sel, "to": to, **({"partial": True} if partial else {})}, dry_run, lambda r: (
        f"{'would move' if r['dry_run'] else 'moved'} {r['chunks']} chunk(s), {human(r['bytes'])} to {r['to']}"
        + (f" ({r['skipped']} already there)" if r["skipped"] else "") + in_tier_now(r)), long=True)


def in_tier_now(r: dict[str, Any]) -> str:
    """What a move or warm into a local tier left there: the selection's chunks in the tier at
    the end (what eviction may have pushed out again shows here), and what --partial left."""
    if r.get("in_tier") is None:
        return ""
    return ((f"; --partial left {r['left']} chunk(s) where they were (over {human(r['room'])} of room)"
             if r["left"] else "")
            + f"; {r['in_tier']} chunk(s) of the selection {'would be' if r['dry_run'] else 'are'} in {r['to']}"
            + (" then" if r["dry_run"] else " now"))


@app.command()
@with_selectors
def compress(ctx: typer.Context, sel: dict[str, Any],
             level: Annotated[int | None, typer.Option(help="zstd level, 1-19 [default: 1]")] = None,
             codec: Annotated[str, typer.Option(help="zstd-shuffle, zstd or raw",
                                                autocompletion=complete_values("--codec"))] = "zstd-shuffle",
             dry_run: DryRun = False) -> None:
    """Recompress chunks and report the bytes saved.

    \b
    Examples:
      lmctl compress --older-than 1d --dry-run
      lmctl compress --label contracts --level 3
      lmctl compress --codec raw --model smollm2
    """
    if codec == "raw" and level is not None:
        term = Terminal.of(ctx)
        raise typer.Exit(term.report("usage", f"--level {level} means nothing for --codec raw (raw chunks are not "
                                              "compressed): drop --level, or give --codec zstd-shuffle or zstd"))
    args = {**sel, "codec": codec, **({"level": level if level is not None else 1} if codec != "raw" else {})}
    _mutate(ctx, "compress", args, dry_run, _compressed, long=True)


def _compressed(r: dict[str, Any]) -> str:
    saved = r["bytes_saved"]
    dry = r["dry_run"]
    change = (f"{'would save' if dry else 'saved'} {human(saved)}" if saved >= 0
              else f"{'would grow by' if dry else 'grew by'} {human(-saved)}")
    skipped = f"; {r['skipped']} already {r['codec']} at that level" if r["skipped"] else ""
    if dry:
        return (f"would recompress {r['chunks']} chunk(s): {human(r['bytes_before'])} -> about "
                f"{human(r['bytes_after'])} (estimated), {change}{skipped}")
    return (f"recompressed {r['chunks']} chunk(s): {human(r['bytes_before'])} -> {human(r['bytes_after'])}, "
            f"{change}{skipped}")


@app.command("inspect")
@with_selectors
def inspect_(ctx: typer.Context, sel: dict[str, Any]) -> None:
    """Store statistics by tier, model, adapter and label, or one chunk's metadata (--key K).

    With selectors, the statistics of the chunks they pick.

    \b
    Examples:
      lmctl inspect
      lmctl inspect --label contracts
      lmctl inspect --key 48c937a7583e21f2
    """
    _request(ctx, "inspect", sel, _show_inspect)


def _show_inspect(term: Terminal, r: dict[str, Any]) -> None:
    if "chunk" in r:
        now = time.time()

        def shown(k: str, v: Any) -> str:
            if k in ("created", "last_access") and isinstance(v, (int, float)):
                return local_time(v) + f" ({ago(now - v)} ago)"
            if k in ("bytes", "raw_bytes", "disk_bytes") and isinstance(v, int):
                return f"{human(v)} ({v} B)"
            if k == "labels" and isinstance(v, list):
                return ", ".join(map(str, v)) or "-"
            if v is None:
                return "-"
            return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)

        term.table(None, ["field", "value"], [[k, shown(k, v)] for k, v in r["chunk"].items()])
        return
    if "scope" in r:
        term.say(f"selected: {r['chunks']} chunks, {human(r['bytes'])} on disk")
    else:
        term.say(f"{r['chunks']} chunks, {human(r['bytes'])}; write amplification {write_amplification(r)}")
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
    term.say(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}")


@app.command("ls")
@with_selectors
def ls_(ctx: typer.Context, sel: dict[str, Any], limit: Annotated[int, typer.Option(
        help="rows per page (0: all, in key order)", min=0)] = 100,
        sort: Annotated[str, typer.Option(
            help="key, age (oldest first), access (least recently used first) or size (largest first)",
            autocompletion=complete_values("--sort"))] = "key",
        cursor: Annotated[str | None, typer.Option(
            help="continue a listing where the last page ended (its 'next')")] = None) -> None:
    """List chunks matching a selector (all chunks without one), a page at a time.

    \b
    Examples:
      lmctl ls --label contracts
      lmctl ls --sort size --limit 10
      lmctl --json ls --limit 0 --adapter civil | jq -r '.chunks[].key'
    """
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
    term.say(f"{r['total']} chunk(s), {human(r['bytes'])}{more}")
    if r.get("next"):
        term.say(f"next page: {next_page(term, r['next'])}")


def next_page(term: Terminal, cursor: str) -> str:
    """The command line of the next page: this one (its selectors and sort) with ``--cursor``.
    A cache salt is a secret: the line names the option only."""
    words = term.line
    out: list[str] = []
    i = 0
    while i < len(words):
        w = words[i]
        if w in ("--json", "--cursor", "--cache-salt") or w.startswith(("--cursor=", "--cache-salt=")):
            if w == "--cache-salt" or w.startswith("--cache-salt="):
                out += ["--cache-salt", "SALT"]
            i += 2 if w in ("--cursor", "--cache-salt") else 1
            continue
        out.append(w)
        i += 1
    line = shlex.join([*out, "--cursor", cursor])
    return line if term.keep_open else f"lmctl {line}"  # the shell's lines have no lmctl


WARM_KEYS = ("chunks", "bytes", "bytes_before", "bytes_after", "skipped", "missing", "unchecked", "fetched",
             "dry_run", "to", "left", "room", "in_tier", "prefill")

AllowMissing = Annotated[bool, typer.Option(
    "--allow-missing", help="exit 0 even when selected chunks could not be warmed (in no tier, or the remote "
                            "tier did not answer)")]


@app.command()
@with_selectors
def warm(ctx: typer.Context, sel: dict[str, Any], endpoint: Annotated[str | None, typer.Option(
        help="also prefill the document through this OpenAI-compatible server (http://host:port)")] = None,
         to: Annotated[str | None, typer.Option(
             help="the local tier to bring chunks into: dram or nvme [default: dram; with --manifest, the "
                  "default tier where there is no dram]", autocompletion=complete_values("warm --to"))] = None,
         manifest: Annotated[str | None, typer.Option(
             metavar="FILE", help="warm every document of a manifest (pin --export-manifest writes one; "
                                  "'-': stdin)")] = None,
         pin_: Annotated[bool, typer.Option("--pin", help="with --manifest: also pin each entry under its label")]
         = False, allow_missing: AllowMissing = False, partial: Partial = False, dry_run: DryRun = False) -> None:
    """Before a restart or traffic shift: bring chunks (or a manifest's) into dram; --endpoint prefills the rest.

    \b
    Examples:
      lmctl warm --label contracts
      lmctl warm --manifest contracts.json --to nvme
      lmctl warm --model smollm2 --messages lease.json --endpoint http://127.0.0.1:8000
    """
    from .manifest import not_warmed, warm_manifest
    from .prefill import prefill

    term = Terminal.of(ctx)

    def body() -> None:
        if manifest is not None:
            if not warm_manifest(term, manifest, sel, to, endpoint, pin_, dry_run, allow_missing):
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
                            "missing": 0, "unchecked": 0, "fetched": 0, "dry_run": dry_run, "to": None,
                            "left": 0, "room": None, "in_tier": None})
        if "to" not in out:
            out.update(term.call("warm", {**sel, "dry_run": dry_run, **({"to": to} if to else {}),
                                          **({"partial": True} if partial else {})}, long=True))
        term.emit({k: out[k] for k in sorted(out, key=WARM_KEYS.index)}, _show_warm)
        if not_warmed(term, out, allow_missing, estimate=dry_run and endpoint is not None):
            raise typer.Exit(ExitStatus.ERROR)

    term.run(body)


def _show_warm(term: Terminal, r: dict[str, Any]) -> None:
    if "prefill" in r:
        p = r["prefill"]
        term.say(f"prefill: {p['hit_tokens_before']} -> {p['hit_tokens_after']} of {p['total_tokens']} tokens cached")
    if r["to"] is None:
        term.say("no dram tier in this store: the chunks stay where the engine wrote them")
        return
    # the bytes of chunks still in the remote tier are unknown until they are fetched
    unknown = r["fetched"] if r["dry_run"] else 0
    size = (f"{human(r['bytes'])} from local tiers and {unknown} from the remote tier (its sizes are known once "
            "fetched)" if unknown and unknown < r["chunks"] else
            "all from the remote tier (sizes known once fetched)" if unknown else human(r["bytes"]))
    fetched = f" ({r['fetched']} from the remote tier)" if r["fetched"] and not r["dry_run"] else ""
    term.say(f"{'would bring' if r['dry_run'] else 'brought'} {r['chunks']} chunk(s) into {r['to']}: {size}{fetched}"
             + (f"; {r['skipped']} already there" if r["skipped"] else "")
             + (f"; {r['missing']} in no tier" if r["missing"] else "")
             + (f"; remote tier did not answer ({r['unchecked']} chunk(s) not checked)" if r["unchecked"] else "")
             + in_tier_now(r))


@app.command()
def verify(ctx: typer.Context, deep: Annotated[bool, typer.Option(help="read and checksum every payload")] = False,
           fix: Annotated[bool, typer.Option(help="repair what is found")] = False) -> None:
    """Check index/segment consistency (and checksums with --deep); --fix repairs.

    \b
    Examples:
      lmctl verify
      lmctl verify --deep --fix
    """
    _request(ctx, "verify", {"deep": deep, "fix": fix}, _show_verify, long=True, ok=lambda r: r["ok"])


def _show_verify(term: Terminal, r: dict[str, Any]) -> None:
    for p in r["problems"]:
        term.say(f"{'fixed' if p['fixed'] else 'found'}: {p['kind']}: {p['detail']}")
    left = sum(1 for p in r["problems"] if not p["fixed"])
    checked = r.get("checked")
    what = f"{checked['chunks']} chunk(s) in {checked['segments']} segment(s)" if checked else "the store"
    how = ("deep: every payload read and checksummed" if r["deep"] else
           "shallow: the index against the segment files and the counts; --deep also reads every payload")
    # what --deep found (bad payloads) only a deep pass can fix
    again = "lmctl verify --deep --fix" if r["deep"] else "lmctl verify --fix"
    term.say(f"ok: checked {what} ({how})" if not left else
             f"{left} problem(s) left; run {again} (checked {what}, {'deep' if r['deep'] else 'shallow'})")


@app.command()
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
        from .top import rates, run

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


@app.command()
def shell(ctx: typer.Context) -> None:
    """An interactive session over one connection: history, tab completion, help.

    \b
    Examples:
      lmctl shell
      printf 'status\\nls --limit 5\\n' | lmctl shell
    """
    from .shell import Shell

    term = Terminal.of(ctx)
    term.keep_open = True
    raise typer.Exit(Shell(app, term).loop())


# -- completion scripts ---------------------------------------------------------------------
completion_app = typer.Typer(help="Shell completion scripts (bash, zsh, fish).", no_args_is_help=True)
app.add_typer(completion_app, name="completion")


@completion_app.command("show")
def completion_show(ctx: typer.Context, shell_name: Annotated[str, typer.Argument(
        metavar="SHELL", help="bash, zsh or fish", autocompletion=complete_values("SHELL"))]) -> None:
    """Print the completion script for a shell.

    \b
    Examples:
      lmctl completion show bash > /etc/bash_completion.d/lmctl
      source <(lmctl completion show bash)
    """
    from . import completion

    term = Terminal.of(ctx).without_json()
    term.run(lambda: term.echo(completion.script(shell_name), end=""))


@completion_app.command("install")
def completion_install(ctx: typer.Context, shell_name: Annotated[str | None, typer.Option(
        "--shell", help="bash, zsh or fish [default: from $SHELL]", autocompletion=complete_values("--shell"))]
        = None) -> None:
    """Install the completion script where the shell finds it (in your home folder).

    \b
    Examples:
      lmctl completion install
      lmctl completion install --shell zsh
    """
    from . import completion

    term = Terminal.of(ctx).without_json()

    def body() -> None:
        for line in completion.install(shell_name, os.path.expanduser("~"), os.environ.get("SHELL", "bash")):
            term.echo(line)

    term.run(body)


# -- the remote tier's secret -----------------------------------------------------------------
remote_app = typer.Typer(help="The shared remote tier (Redis): its deployment secret.", no_args_is_help=True)
app.add_typer(remote_app, name="remote")


@remote_app.command("secret")
def remote_secret(ctx: typer.Context, path: Annotated[str, typer.Argument(
        metavar="PATH", help="the file to create (it must not exist)")]) -> None:
    """Generate a deployment secret (32 random bytes, hex, a new file of mode 0600); no daemon needed.

    Give it to every store of the deployment as remote.secret_file (copy it to each host
    over a private channel).

    \b
    Examples:
      lmctl remote secret /etc/lmctl/remote.secret
      lmctl config set remote.secret_file=/etc/lmctl/remote.secret
    """
    from .secret import SECRET_BYTES, new_secret

    term = Terminal.of(ctx)

    def body() -> None:
        r = {"path": new_secret(path), "bytes": SECRET_BYTES, "mode": "0600"}
        term.emit(r, lambda t, r: t.console().print(
            f"wrote a new remote secret to {path} (mode 0600); set remote.secret_file to it on every store that "
            "shares the tier"))

    term.run(body)


# -- settings -----------------------------------------------------------------------------------
config_app = typer.Typer(help="Show or change the store's settings through the daemon.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """The store's settings (tiers, capacities, pin budgets, codec, ...).

    \b
    Examples:
      lmctl config show
      lmctl --json config show | jq .settings.tiers
    """
    _request(ctx, "config", {}, _show_settings)


SETTINGS_HELP = (f"Keys: {', '.join(STORE_SETTINGS)}; {', '.join(f'tiers.TIER.{k}' for k in TIER_SETTINGS)} (TIER: "
                 f"dram or nvme; naming a tier that is not configured adds it); "
                 f"{', '.join(f'remote.{k}' for k in REMOTE_SETTINGS)} (remote.url=none removes the remote tier). "
                 "Sizes need a unit (500GiB, 1TB), durations too (90s, 12h, 7d).")


@config_app.command("set", epilog=SETTINGS_HELP)
def config_set(ctx: typer.Context, pairs: Annotated[list[str], typer.Argument(
        metavar="KEY=VALUE", help="e.g. tiers.nvme.capacity=500GiB codec=zstd-shuffle",
        autocompletion=complete_values("KEY=VALUE"))]) -> None:
    """Change store settings (validated, recorded in the store, applied at once).

    \b
    Examples:
      lmctl config set tiers.nvme.capacity=500GiB
      lmctl config set codec=zstd-shuffle codec_level=3 retire_after_s=12h
    """
    _request(ctx, "config", lambda: {"set": _changes(pairs)}, _show_settings)


def _changes(pairs: list[str]) -> dict[str, str]:
    changes: dict[str, str] = {}
    for p in pairs:
        k, sep, v = p.partition("=")
        if not sep or not k.strip():
            raise CommandError("usage", f"{p!r} is not KEY=VALUE (e.g. tiers.nvme.capacity=500GiB)")
        if k.strip() in changes:
            raise CommandError("usage", f"{k.strip()} is set twice ({k.strip()}={changes[k.strip()]}, {p}): "
                                        "give it once")
        changes[k.strip()] = v.strip()
    return changes


def _show_settings(term: Terminal, r: dict[str, Any]) -> None:
    cfg = r["settings"]
    rows = [[k, json.dumps(v) if not isinstance(v, str) else v] for k, v in cfg.items() if k != "tiers"]
    for name, t in cfg["tiers"].items():
        rows += [[f"tiers.{name}.{k}", json.dumps(v) if not isinstance(v, str) else v] for k, v in t.items()]
    term.table(None, ["setting", "value"], rows)
    if r.get("changed"):
        term.say("changed: " + ", ".join(r["changed"]))


# -- help -----------------------------------------------------------------------------------------
@app.command("help")
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


if __name__ == "__main__":
    main()
