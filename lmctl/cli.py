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
#: how a listing is printed (``-o``): see ``_formats``
OUTPUTS = ("wide", "tsv", "name")
Output = Annotated[str | None, typer.Option(
    "-o", "--output", help="wide (a table with full keys), tsv (tab-separated values, raw numbers and ISO times, "
                           "a header line first) or name (one full chunk key a line, for --key)",
    autocompletion=complete_values("--output"))]
NoHeaders = Annotated[bool, typer.Option("--no-headers", help="leave out the header line (tables and -o tsv)")]


def _formats(ctx: typer.Context, output: str | None, no_headers: bool) -> Terminal:
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
    allow_uid_ro: Annotated[list[int] | None, typer.Option(
        "--allow-uid-ro", help="also accept clients of this uid for reads only (status, ls, lookup, inspect, "
                               "events, verify, top, dry runs); repeatable")] = None,
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
            # --quiet: the daemon logs warnings and errors only, unless a level is given
            level = (log_level or daemon.get("log_level") or ("warning" if term.quiet else "info")).upper()
            if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
                raise CommandError("usage", f"--log-level must be debug, info, warning or error, not {level.lower()!r}")
            interval = check_interval(maintenance_interval if maintenance_interval is not None else daemon.get(
                "maintenance_interval", 30))
            uids = [check_id(u, "--allow-uid") for u in allow_uid or daemon.get("allow_uid") or []]
            ro_uids = [check_id(u, "--allow-uid-ro") for u in allow_uid_ro or daemon.get("allow_uid_ro") or []]
            both = sorted(set(uids) & set(ro_uids))
            if both:
                raise CommandError("usage", f"uid {both[0]} is given both full (--allow-uid) and read-only "
                                            "(--allow-uid-ro) access: give one")
            mode, gid = socket_access(socket_mode or daemon.get("socket_mode") or "0600",
                                      socket_group or daemon.get("socket_group"))
            logging.basicConfig(stream=term.err, level=getattr(logging, level),
                                format="%(asctime)s lmctl[%(process)d] %(levelname)s %(message)s")
            listen = metrics or daemon.get("metrics")
            clean = Daemon(store_dir, sock, uids, interval, socket_mode=mode, socket_group=gid, init=init,
                           settings=changes, metrics=None if listen is None else str(listen),
                           allow_ro_uids=ro_uids).serve()
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
def status(
    ctx: typer.Context,
    check: Annotated[bool, typer.Option(
        "--check", help="health check for probes: exit 0 when healthy, 1 with one line per reason when something "
                        "needs an operator, 3 when the daemon does not answer")] = False,
    timeout: Annotated[float | None, typer.Option(
        metavar="S", min=0.1, max=3600,
        help="give up when the daemon has not answered within S seconds [default: 10 with --check, else none]")] = None,
) -> None:
    """Daemon and store health: tiers, usage, capacity, maintenance, running and failed jobs.

    \b
    Examples:
      lmctl status
      lmctl --json status | jq .store.tiers
      lmctl status --check --timeout 5     # a probe: exit 0 healthy, 1 unhealthy, 3 no daemon
    """
    if not check:
        term = Terminal.of(ctx)
        with _deadline(term, timeout):
            _request(ctx, "status", {}, _show_status)
        return
    _check(Terminal.of(ctx), 10.0 if timeout is None else timeout)


@contextmanager
def _deadline(term: Terminal, timeout: float | None) -> Iterator[None]:
    """Requests made meanwhile give up after ``timeout`` seconds without an answer (None:
    as the terminal's connection already does)."""
    if timeout is None:
        yield
        return
    from .client import Client

    if term.client is None:
        term.client = Client(term.address, timeout=timeout, daemon_uids=term.daemon_uids)
        yield
        return
    before = term.client.timeout  # the shell's kept connection
    term.client.timeout = timeout
    try:
        yield
    finally:
        if term.client is not None:
            term.client.timeout = before


def _check(term: Terminal, timeout: float) -> None:
    """``status --check``: healthy or not, each reason a line (under --json, an object); a
    daemon that cannot be asked is a reason too, with that failure's exit status."""
    from .terminal import classify

    status = ExitStatus.OK
    try:
        with _deadline(term, timeout):
            r = term.call("status")
        health = r.get("health") or {"healthy": False, "reasons": [
            {"code": "unknown", "message": "the daemon does not report its health (an older lmctl?)"}]}
        reasons = list(health["reasons"])
        if reasons:
            status = ExitStatus.UNHEALTHY
    except typer.Exit:
        raise
    except KeyboardInterrupt:
        raise typer.Exit(term.fail(KeyboardInterrupt())) from None
    except Exception as exc:  # unreachable, untrusted, denied: the check could not be made
        term.hang_up()
        failure = classify(exc)
        if not term.json:
            raise typer.Exit(term.show_failure(failure)) from None
        reasons, status = [{"code": failure.code, "message": failure.message}], failure.status
    try:
        if term.json:
            term.echo(json.dumps({"healthy": not reasons, "reasons": reasons}))
        elif not reasons:
            term.say("healthy")
        else:
            for why in reasons:
                term.say(f"{why['code']}: {why['message']}")
    except BrokenPipeError:
        term.silence()
    raise typer.Exit(status)


def _show_status(term: Terminal, r: dict[str, Any]) -> None:
    from rich.markup import escape

    d = r["daemon"]
    c = term.console()
    if term.chatty:
        c.print(f"lmctl {d['version']} serving [bold]{escape(printable(r['store']['path']))}[/bold] on "
                f"{escape(printable(d['socket']))} (pid {d['pid']}, up {d['uptime_s']:.0f} s, "
                f"{d['clients']} client(s))")
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
    term.say(_maintenance_line(d.get("maintenance") or {}))
    for note in r["store"].get("notes") or []:
        term.say(f"note: {note}")
    for j in r["jobs"]:
        term.say(f"job {j['id']}: {j['cmd']} {j['what']} {j['done']}/{j['total']}")
    failed = r.get("failed_jobs") or []
    if failed:
        term.say(f"failed jobs (the last {len(failed)}, newest first):")
        for j in failed:
            term.say(f"  {_utc(j['at'])}  job {j['id']} {j['cmd']}: {j['error']}")
    health = r.get("health")
    if health is not None:
        if health["healthy"]:
            term.say("health: ok")
        else:
            term.say(f"health: {len(health['reasons'])} problem(s) (lmctl status --check):")
            for why in health["reasons"]:
                term.say(f"  {why['code']}: {why['message']}")


def _utc(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def _maintenance_line(m: dict[str, Any]) -> str:
    """The maintenance thread's state in one line."""
    every = f"every {m['interval_s']:g} s" if m.get("interval_s") else ""
    if m.get("consecutive_failures"):
        ok = f"; last worked {_utc(m['last_ok_at'])}" if m.get("last_ok_at") else "; it has not worked yet"
        return (f"maintenance: FAILING since {_utc(m['failing_since'])}, {m['consecutive_failures']} pass(es) in a "
                f"row ({m['failures_total']} in all){ok}: {m['last_error']}")
    if m.get("last_ok_at") is None:
        return f"maintenance: {every}, no pass yet"
    from .health import describe_pass

    line = f"maintenance: {every}, last pass {_utc(m['last_ok_at'])} ({describe_pass(m.get('last_ok') or {})})"
    if m.get("failures_total"):
        line += (f"; {m['failures_total']} failed pass(es) since the daemon started, the last at "
                 f"{_utc(m['last_error_at'])}: {m['last_error']}")
    return line


def _tiers(term: Terminal, tiers: dict[str, Any]) -> None:
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


@app.command()
@with_selectors
def lookup(ctx: typer.Context, sel: dict[str, Any], explain: Annotated[bool, typer.Option(
        "--explain", help="say why the first missing chunk misses (a reason code and a sentence)")] = False,
           min_hit: Annotated[float | None, typer.Option(
               "--min-hit", help="exit 1 (with one line) unless at least this fraction of the document's tokens "
                                 "is cached, 0-1 (e.g. 0.9)")] = None,
           router: Annotated[str | None, typer.Option(
               metavar="URL", help="also ask a router's KV index (Dynamo's KV indexer, POST URL/query) which "
                                   "instances hold the document, how much of it and in which tier")] = None,
           router_model: Annotated[str | None, typer.Option(
               metavar="NAME", help="with --router: the model name the router knows the engines by "
                                    "(default: the document's model id)")] = None) -> None:
    """How much of a document is cached: hit tokens, chunks per tier, first miss (--explain: why).

    \b
    Examples:
      lmctl lookup --model smollm2 --messages chat.json --explain
      lmctl lookup --adapter civil --file contract.txt
      lmctl -q lookup --file contract.txt --min-hit 0.9 || lmctl warm --file contract.txt
      lmctl --json lookup --key 48c937a7583e21f2
      lmctl lookup --file contract.txt --router http://router:8090 --router-model smollm2
    """
    term = Terminal.of(ctx)
    if min_hit is not None and not 0 <= min_hit <= 1:
        raise typer.Exit(term.report("usage", f"--min-hit must be a fraction between 0 and 1 (0.9: 90%), not "
                                              f"{min_hit:g}"))

    def enough(r: dict[str, Any]) -> bool:
        if min_hit is None:
            return True
        total = r.get("total_tokens") or 0
        got = r["hit_tokens"] / total if total else 0.0
        if got >= min_hit:
            return True
        if not term.json:  # JSON says it all: the result, and the exit status
            print(f"lmctl: {100 * got:.1f}% of the document is cached ({r['hit_tokens']} of {total} tokens), "
                  f"below --min-hit {min_hit:g}", file=term.err)
        return False

    # a gate under --quiet: the exit status is the answer, the line below says why it failed
    show: Show = (lambda t, r: None) if term.quiet and min_hit is not None else _show_lookup
    if router is not None or router_model is not None:
        _lookup_router(term, sel, explain, router, router_model, show, enough)
        return
    _request(ctx, "lookup", {**sel, "explain": True} if explain else sel, show, ok=enough)


def _lookup_router(term: Terminal, sel: dict[str, Any], explain: bool, url: str | None,
                   model: str | None, show: Show, ok: Callable[[dict[str, Any]], bool]) -> None:
    """``lookup --router``: this store's answer, then the router's, per instance."""
    from .router import ask, query_url

    def body() -> None:
        if url is None:
            raise CommandError("usage", "--router-model needs --router URL (the router index to ask)")
        query_url(url)  # a bad URL is a usage error before the daemon is asked
        r = term.call("lookup", {**sel, "token_ids": True, **({"explain": True} if explain else {})})
        tokens = r.pop("token_ids", None)
        if not tokens:
            raise CommandError("usage", "--router needs a document (--text, --file, --tokens or --messages): the "
                                        "router is asked by its tokens")
        ns = r.get("namespace") or {}
        name = model or ns.get("model")
        if not name:
            raise CommandError("usage", "the document's model is not known here: pass --router-model NAME")
        adapter = ns.get("adapter")
        lora = None if not adapter else str(adapter).split("@", 1)[0]
        r["router"] = {"url": url, "model_name": name, "lora_name": lora,
                       "instances": ask(url, [int(t) for t in tokens], name, lora)}
        term.emit(r, show)
        if not ok(r):
            raise typer.Exit(ExitStatus.ERROR)

    term.run(body)


def _show_lookup(term: Terminal, r: dict[str, Any]) -> None:
    from rich.text import Text

    n, size, total = len(r["chunks"]), r.get("chunk_size"), r.get("total_tokens") or 0
    part = r.get("partial")
    short = n == 0 and total > 0 and not part  # a document shorter than one chunk, none of it stored
    if short:
        term.say(f"the document's {total} token(s) are less than one chunk of {size}: nothing of it is stored "
                 "(an engine stores a request's partial last chunk in whole blocks; none of these)")
    elif total:
        pct = 100 * r["hit_tokens"] / total
        tail = total - n * size if size else 0
        held = (f", and the first {part['tokens']} tokens of chunk {part['chunk']} ({part['tier']}, "
                + ("a request's tail record" if part["via"] == "tail" else
                   f"the first blocks of a record of {part['record_tokens']} tokens") + ")"
                if part else "")
        term.say(f"{r['hit_tokens']} of {total} tokens cached ({pct:.0f}%), {r['hit_chunks']} of {n} full chunks"
                 + held
                 + (f"; first miss at token {r['first_miss']}" if r.get("first_miss") is not None
                    and r["hit_chunks"] < n else "")
                 + (f"; the last {tail} token(s) are less than a chunk" if tail > 0 and not part else ""))
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
    if "router" in r:
        _show_router(term, r["router"], total)


def _show_router(term: Terminal, routed: dict[str, Any], total: int) -> None:
    insts = routed["instances"]
    who = routed["model_name"] + (f", adapter {routed['lora_name']}" if routed.get("lora_name") else "")
    if not insts:
        term.say(f"router {routed['url']} ({who}): no instance holds any of it")
        return
    term.say(f"router {routed['url']} ({who}): {len(insts)} instance(s) hold some of it")
    rows = [[wid, str(v["longest_matched"]), f"{100 * v['longest_matched'] / total:.0f}%" if total else "-",
             str(v["gpu"]), str(v["cpu"]), str(v["disk"])]
            for wid, v in sorted(insts.items(), key=lambda kv: -kv[1]["longest_matched"])]
    term.table(None, ["instance", "tokens", "of doc", "gpu", "cpu", "disk"], rows,
               {"tokens", "of doc", "gpu", "cpu", "disk"})


@app.command()
def events(ctx: typer.Context, since: Annotated[str | None, typer.Option(
        help="only events of the last DURATION: 90s, 30m, 1h, 7d, 1h30m (a unit is required)")] = None,
           kind: Annotated[list[str] | None, typer.Option(
               help="evict, corrupt, save-dropped, pin, unpin, remote-copy or announce (KV events engines "
                    "published); repeatable",
               autocompletion=complete_values("--kind"))] = None,
           limit: Annotated[int, typer.Option(help="the newest N events (0: all)", min=0)] = 50,
           output: Output = None, no_headers: NoHeaders = False,
           follow: Annotated[bool, typer.Option(
               "-f", "--follow", help="then print new events as they come, until Ctrl-C or SIGTERM "
                                      "(--json: one JSON line per event)")] = False,
           interval: Annotated[float, typer.Option(
               help="with --follow: seconds between two looks at the log, 0.1-60")] = 1.0) -> None:
    """The store's bounded event log: evictions, corrupt drops, dropped saves, pins, KV events announced.

    \b
    Examples:
      lmctl events --since 1h --kind evict
      lmctl events --follow --kind evict --kind corrupt
      lmctl events --kind announce --since 10m
      lmctl events -o tsv --limit 0 > events.tsv
      lmctl --json events --limit 0 | jq '.events[] | select(.kind == "corrupt")'
    """
    from .units import parse_duration

    term = _formats(ctx, output, no_headers)

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

    if not follow:
        _request(ctx, "events", args, _show_events)
        return

    def body() -> None:
        if not 0.1 <= interval <= 60:
            raise CommandError("usage", f"--interval must be between 0.1 and 60 seconds, not {interval}")
        _follow_events(term, args(), interval)

    term.run(body)


def _follow_events(term: Terminal, first: dict[str, Any], interval: float) -> None:
    """``events --follow``: the events ``first`` asks for, then each new one as it comes (a
    look at the log every ``interval`` seconds, over one connection), until Ctrl-C (exit 130)
    or SIGTERM (exit 0)."""
    import signal
    import threading

    stop = threading.Event()
    previous: Any = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, lambda *_: stop.set())
    kept, term.keep_open = term.keep_open, True
    header = [not (term.no_headers or term.quiet or term.json or term.output == "name")]
    try:
        r = term.call("events", first)
        _event_lines(term, r["events"], header)
        after = int(r["last_seq"])
        nxt = {k: v for k, v in first.items() if k == "kind"}
        while not stop.is_set():
            end = time.monotonic() + interval
            while not stop.is_set() and time.monotonic() < end:  # SIGTERM is heard within 0.1 s
                time.sleep(min(0.1, max(0.0, end - time.monotonic())))
            if stop.is_set():
                break
            r = term.call("events", {**nxt, "limit": 0, "after": after})
            _event_lines(term, r["events"], header)
            after = max(after, int(r["last_seq"]))
    except KeyboardInterrupt:  # Ctrl-C ends a follow: no job to cancel, nothing to say
        raise typer.Exit(ExitStatus.INTERRUPTED) from None
    finally:
        term.keep_open = kept
        if not kept:
            term.hang_up()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _event_lines(term: Terminal, events: list[dict[str, Any]], header: list[bool]) -> None:
    """Events as ``--follow`` prints them, a line each as they come (a table would wait for
    its widest row): JSON lines, keys, TSV or aligned columns. ``header``: whether the
    header line is still to print (printed once, before the first event)."""
    if not events:
        return
    if term.json:
        lines = [json.dumps(e) for e in events]
    elif term.output == "name":
        lines = [e["key"] for e in events if e.get("key")]
    elif term.output == "tsv":
        lines = ["\t".join(printable(str(c)) for c in [iso_time(e["time"]), e["kind"], e["reason"], e["chunks"],
                 *("" if e.get(k) is None else e[k] for k in EVENT_FIELDS)]) for e in events]
        if header[0]:
            lines.insert(0, "\t".join(["time", "kind", "reason", "chunks", *EVENT_FIELDS]))
    else:
        lines = [printable(f"{local_time(e['time'])}  {e['kind']:<12} {e['reason']:<15} {e['chunks']:>6}  "
                           f"{event_details(term, e)}".rstrip()) for e in events]
        if header[0]:
            lines.insert(0, f"{'time':<25}  {'kind':<12} {'reason':<15} {'chunks':>6}  details")
    header[0] = False
    if lines:
        term.echo("\n".join(lines))
        term.out.flush()  # each event for the reader of a pipe as it comes


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


EVENT_FIELDS = ("tier", "label", "uid", "bytes", "key", "detail")


def event_details(term: Terminal, e: dict[str, Any]) -> str:
    """An event's details for people: tier, label, user, size, first chunk, detail."""
    what = [f"{k} {e[k]}" for k in ("tier", "label") if e.get(k) is not None]
    if e.get("uid") is not None:
        what.append(f"uid {user(e['uid'])}")
    if e.get("bytes"):
        what.append(human(e["bytes"]))
    if e.get("key"):
        what.append(f"first chunk {e['key'] if term.output == 'wide' else chunk_id(e['key'])}")
    if e.get("detail"):
        what.append(str(e["detail"]))
    return ", ".join(what)


def _show_events(term: Terminal, r: dict[str, Any]) -> None:
    if term.output == "name":
        keys_only(term, [e.get("key") for e in r["events"]])
        return
    if term.output == "tsv":
        term.table(None, ["time", "kind", "reason", "chunks", *EVENT_FIELDS],
                   [[iso_time(e["time"]), e["kind"], e["reason"], e["chunks"],
                     *("" if e.get(k) is None else e[k] for k in EVENT_FIELDS)] for e in r["events"]])
        return
    rows = [[local_time(e["time"]), e["kind"], e["reason"], str(e["chunks"]), event_details(term, e)]
            for e in r["events"]]
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
        "--force", help="evict pinned chunks too")] = False, dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="list what would go (keys and sizes) and evict nothing")] = False,
          output: Output = None, no_headers: NoHeaders = False) -> None:
    """Remove chunks from the store (never pinned ones unless --force); --dry-run lists what would go.

    \b
    Examples:
      lmctl evict --older-than 7d --unpinned --dry-run
      lmctl evict --older-than 7d --unpinned --dry-run -o name > old.keys
      lmctl evict --adapter civil@3f9a51c2
    """
    term = _formats(ctx, output, no_headers)
    if output is not None and not dry_run:
        raise typer.Exit(term.report("usage", f"-o {output} lists what --dry-run would evict: add --dry-run"))

    def line(r: dict[str, Any]) -> str:
        return (f"{'would evict' if r['dry_run'] else 'evicted'} {r['chunks']} chunk(s), {human(r['bytes'])}"
                + (f"; {r['skipped_pinned']} pinned chunk(s) kept" if r["skipped_pinned"] else "")
                + (f"; {r['pinned_removed']} of them pinned ({'would be' if r['dry_run'] else 'were'} removed by "
                   "--force; their pins stay and protect them when stored again)" if r["pinned_removed"] else ""))

    def show(term: Terminal, r: dict[str, Any]) -> None:
        if r["dry_run"]:
            _show_victims(term, r["keys"], r["chunks"])
        term.say(line(r))

    # a table shows the first rows; scripts (-o name|tsv, --json) get them all
    rows = (1 << 40) if term.json or output in ("name", "tsv") else VICTIM_ROWS + 1
    _request(ctx, "evict", {**sel, "force": force, "dry_run": dry_run, **({"list": rows} if dry_run else {})},
             show, long=True)


#: rows of a dry run's table at most (``-o name`` and ``-o tsv`` list them all)
VICTIM_ROWS = 1000


def _show_victims(term: Terminal, rows: list[dict[str, Any]], total: int) -> None:
    """What ``evict --dry-run`` would evict: a table, TSV, or keys (``-o name``)."""
    if term.output == "name":
        keys_only(term, [x["key"] for x in rows])
        return
    if term.output == "tsv":
        term.table(None, ["key", "tier", "bytes", "pins"], [[x["key"], x["tier"], x["bytes"], x["pins"]]
                                                            for x in rows])
        return
    wide = term.output == "wide"
    term.table(None, ["key" if wide else "chunk hash", "tier", "bytes", "pins"],
               [[x["key"] if wide else chunk_id(x["key"]), x["tier"], human(x["bytes"]), str(x["pins"])]
                for x in rows[:VICTIM_ROWS]], {"bytes", "pins"})
    if total > VICTIM_ROWS:
        term.say(f"... and {total - VICTIM_ROWS} more (-o name or -o tsv lists them all)")


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
def inspect_(ctx: typer.Context, sel: dict[str, Any], output: Output = None, no_headers: NoHeaders = False) -> None:
    """Store statistics by tier, model, adapter and label, or one chunk's metadata (--key K).

    With selectors, the statistics of the chunks they pick.

    \b
    Examples:
      lmctl inspect
      lmctl inspect --label contracts -o tsv
      lmctl inspect --key 48c937a7583e21f2
    """
    term = _formats(ctx, output, no_headers)
    if output == "name" and not sel.get("keys"):
        raise typer.Exit(term.report("usage", "-o name prints chunk keys: inspect without --key shows statistics; "
                                              "lmctl ls -o name lists the keys a selector picks"))
    _request(ctx, "inspect", sel, _show_inspect)


def _show_inspect(term: Terminal, r: dict[str, Any]) -> None:
    if "chunk" in r and term.output == "name":
        keys_only(term, [r["chunk"].get("key")])
        return
    if "chunk" in r and term.output == "tsv":
        term.table(None, ["field", "value"], [[k, "" if v is None else v if isinstance(v, str) else json.dumps(v)]
                                              for k, v in r["chunk"].items()])
        return
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
    if term.output == "tsv":
        _inspect_tsv(term, r)
        return
    wide = term.output == "wide"
    if "scope" in r:
        term.say(f"selected: {r['chunks']} chunks, {human(r['bytes'])} on disk")
    else:
        term.say(f"{r['chunks']} chunks, {human(r['bytes'])}; write amplification {write_amplification(r)}")
    _tiers(term, r["tiers"])
    if r["models"]:
        term.table("models (one row per checkpoint fingerprint)",
                   ["model", "fingerprint", "last used", "chunks", "bytes"],
                   [[m["model"], (m["fingerprint"] or "-")[:None if wide else 12]
                     + (" (retired)" if m["retired"] else ""),
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


def _inspect_tsv(term: Terminal, r: dict[str, Any]) -> None:
    """``inspect -o tsv``: a section per table (tiers, models, adapters, labels), a blank line
    between two; each section's first column names what its rows count."""
    sections = [lambda: _tiers(term, r["tiers"])]
    if r["models"]:
        sections.append(lambda: term.table(None, ["model", "fingerprint", "retired", "last_used", "chunks", "bytes"], [
            [m["model"], m["fingerprint"] or "", str(m["retired"]).lower(),
             iso_time(m["last_used"]) if m["last_used"] else "", m["chunks"], m["bytes"]] for m in r["models"]]))
    if r["adapters"]:
        sections.append(lambda: term.table(None, ["model", "adapter", "chunks", "bytes"], [
            [a["model"], a["adapter"] or "", a["chunks"], a["bytes"]] for a in r["adapters"]]))
    if r["labels"]:
        sections.append(lambda: term.table(None, ["label", "chunks"], [[k, v] for k, v in r["labels"].items()]))
    for i, show in enumerate(sections):
        if i:
            term.echo()
        show()


@app.command("ls")
@with_selectors
def ls_(ctx: typer.Context, sel: dict[str, Any], limit: Annotated[int, typer.Option(
        help="rows per page (0: all, in key order)", min=0)] = 100,
        sort: Annotated[str, typer.Option(
            help="key, age (oldest first), access (least recently used first) or size (largest first)",
            autocompletion=complete_values("--sort"))] = "key",
        cursor: Annotated[str | None, typer.Option(
            help="continue a listing where the last page ended (its 'next')")] = None,
        output: Output = None, no_headers: NoHeaders = False) -> None:
    """List chunks matching a selector (all chunks without one), a page at a time.

    \b
    Examples:
      lmctl ls --label contracts
      lmctl ls --sort size --limit 10 -o wide
      lmctl ls --limit 0 --adapter civil -o name
    """
    _formats(ctx, output, no_headers)
    _request(ctx, "ls", {**sel, "limit": limit, "sort": sort, **({"cursor": cursor} if cursor else {})}, _show_ls)


def ago(seconds: float) -> str:
    """A duration the way a listing shows it: 45s, 12m, 3h, 9d."""
    s = max(0.0, seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= size:
            return f"{s / size:.0f}{unit}"
    return f"{s:.0f}s"


LS_TSV = ("key", "tier", "bytes", "tokens", "pins", "hits", "created", "last_access", "model", "adapter", "codec")


def _show_ls(term: Terminal, r: dict[str, Any]) -> None:
    if term.output == "name":
        keys_only(term, [x["key"] for x in r["chunks"]])
    elif term.output == "tsv":
        term.table(None, list(LS_TSV), [[iso_time(x[k]) if k in ("created", "last_access") else
                                         "" if x[k] is None else x[k] for k in LS_TSV] for x in r["chunks"]])
    if term.output in ("name", "tsv"):
        return
    now = time.time()
    wide = term.output == "wide"
    rows = [[x["key"] if wide else chunk_id(x["key"]), x["tier"], human(x["bytes"]), str(x["tokens"]), str(x["pins"]),
             str(x["hits"]), ago(now - x["created"]), ago(now - x["last_access"]) + " ago",
             x["adapter"] or "(base)", *([x["model"] or "-", x["codec"]] if wide else [])] for x in r["chunks"]]
    term.table(None, ["key" if wide else "chunk hash", "tier", "bytes", "tokens", "pins", "hits", "age",
                      "last access", "adapter", *(["model", "codec"] if wide else [])],
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


@app.command()
def drain(ctx: typer.Context, manifest: Annotated[str, typer.Option(
        metavar="FILE", help="write the manifest of what went to FILE, for the replacement's warm --manifest")],
          budget: Annotated[str | None, typer.Option(
              help="copy at most SIZE of stored bytes: 2GiB, 500MiB (a unit is required)")] = None,
          deadline: Annotated[str | None, typer.Option(
              help="stop copying after DURATION: 90s, 5m, 1h (a unit is required)")] = None,
          dry_run: DryRun = False) -> None:
    """Before scale-down: copy this instance's chunks to the remote tier, pinned then hottest first, with a report.

    The local copies stay. Exit 1 when pinned entries were left behind (budget, deadline, the
    remote tier refused them) or the remote tier refused chunks; 130 on Ctrl-C, with a manifest
    of what went.

    \b
    Examples:
      lmctl drain --manifest drain.json --budget 20GiB --deadline 5m
      lmctl drain --manifest drain.json --dry-run
      lmctl warm --manifest drain.json   (on the replacement)
    """
    from .drain import drain as run_drain

    term = Terminal.of(ctx)

    def body() -> None:
        if not run_drain(term, manifest, budget, deadline, dry_run):
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
        term.emit(r, lambda t, r: t.say(
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
                 f"dram or nvme; naming a tier that is not configured adds it, tiers.TIER=none removes an empty "
                 f"one); "
                 f"{', '.join(f'remote.{k}' for k in REMOTE_SETTINGS)} (remote.url=none removes the remote tier). "
                 "Sizes need a unit (500GiB, 1TB), durations too (90s, 12h, 7d).")


@config_app.command("set", epilog=SETTINGS_HELP)
def config_set(ctx: typer.Context, pairs: Annotated[list[str], typer.Argument(
        metavar="KEY=VALUE", help="e.g. tiers.nvme.capacity=500GiB codec=zstd-shuffle",
        autocompletion=complete_values("KEY=VALUE"))], dry_run: Annotated[bool, typer.Option(
            "--dry-run", help="check the settings and say what a smaller capacity would evict; change nothing")]
        = False) -> None:
    """Change store settings (validated, recorded in the store, applied at once).

    \b
    Examples:
      lmctl config set tiers.nvme.capacity=200GiB --dry-run
      lmctl config set tiers.nvme.capacity=500GiB
      lmctl config set codec=zstd-shuffle codec_level=3 retire_after_s=12h
    """
    _request(ctx, "config", lambda: {"set": _changes(pairs), **({"dry_run": True} if dry_run else {})},
             lambda term, r: _show_config_dry_run(term, r) if r.get("dry_run") else
             None if term.quiet else _show_settings(term, r))


def _show_config_dry_run(term: Terminal, r: dict[str, Any]) -> None:
    term.say(f"would change {', '.join(r['changed'])} (nothing applied)")
    for name, e in r["evicts"].items():
        cap = ("" if e["capacity"] == e["capacity_before"] else
               f" (capacity {human(e['capacity_before'])} -> {human(e['capacity'])})")
        if e["chunks"]:
            verb = f"move {e['chunks']} chunk(s), {human(e['bytes'])} to {e['moves_to']}" if e["moves_to"] else \
                f"evict {e['chunks']} chunk(s), {human(e['bytes'])}"
            term.say(f"tier {name}: would {verb} at once{cap}")
        elif cap:
            term.say(f"tier {name}: nothing would be evicted{cap}")


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
    """A row per setting, by the name ``config set`` takes (``remote.url``, ``tiers.nvme.capacity``),
    sizes and durations with their units (``--json`` gives bytes and seconds)."""
    from .completion import flatten

    rows = [[k, setting_text(k, v)] for k, v in flatten(r["settings"]).items()]
    term.table(None, ["setting", "value"], rows)
    if r.get("changed"):
        term.say("changed: " + ", ".join(r["changed"]))
    for note in r.get("notes") or []:
        print(f"lmctl: warning: {printable(note)}", file=term.err)


def setting_text(name: str, value: Any) -> str:
    """A setting's value as an operator writes it: ``64.0 GiB``, ``1h``, ``none``."""
    from .units import format_duration

    if value is None:
        return "none"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value if isinstance(value, str) else json.dumps(value)
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("capacity", "segment_bytes", "piece_bytes") or (leaf == "pin_budget" and value > 1):
        return human(value)
    if leaf.endswith("_s"):
        return format_duration(value)
    return f"{value:g}" if isinstance(value, float) else str(value)


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
