"""The lmctl command line: ``lmctl [--socket PATH] [--json] COMMAND ...``.

Every command except ``serve`` and ``completion`` is a short adapter over one request to
the daemon (``lmctl/ops.py`` does the work there). Output options and selectors are
declared once. Exit codes live in one enum and are mapped from exceptions in one place.
Nothing here imports torch, vllm or numpy, and the store library is imported by ``serve``
only, so ``lmctl --help`` starts fast.
"""

import functools
import inspect
import json
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Annotated, Any

import typer

from . import __version__
from .client import Client, RemoteError, Unreachable, default_socket
from .units import parse_duration


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    UNREACHABLE = 3
    INTERRUPTED = 130  # Ctrl-C: the daemon cancels the job


#: every error code of a reply or of the CLI itself, and its exit code: the one rule
ERROR_EXIT = {"usage": Exit.USAGE, "failed": Exit.FAILED, "protocol": Exit.FAILED, "denied": Exit.FAILED,
              "cancelled": Exit.FAILED, "unreachable": Exit.UNREACHABLE, "interrupted": Exit.INTERRUPTED}


@dataclass
class Terminal:
    """Where output goes: passed around as an object so tests and the shell control it."""

    json: bool = False
    socket: str = field(default_factory=default_socket)
    client: Client | None = None
    keep_open: bool = False  # the shell keeps one connection for the whole session
    socket_given: bool = False  # --socket or $LMCTL_SOCKET named it (serve then uses it)

    def call(self, cmd: str, args: dict[str, Any] | None = None, long: bool = False) -> dict[str, Any]:
        if self.client is None:
            self.client = Client(self.socket)
        try:
            if long and not self.json:
                with _progress() as update:
                    return self.client.call(cmd, args, update)
            return self.client.call(cmd, args)
        finally:
            if not self.keep_open and self.client is not None:
                self.client.close()
                self.client = None


class CommandError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@contextmanager
def _progress() -> Iterator[Callable[[int, int, str], None]]:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   console=console, transient=True, disable=not console.is_terminal)
    task = None
    with bar:
        def update(done: int, total: int, what: str) -> None:
            nonlocal task
            if task is None:
                task = bar.add_task(what or "working", total=total or None)
            bar.update(task, completed=done, total=total or None, description=what or "working")

        yield update


def report(as_json: bool, code: str, message: str) -> int:
    """Print an error as one line (stderr) or a JSON object (stdout); its exit code."""
    exit_code = int(ERROR_EXIT.get(code, Exit.FAILED))
    message = " ".join(str(message).split())  # one line, whatever the message held
    if as_json:
        print(json.dumps({"error": {"code": code, "message": message, "exit": exit_code}}))
    else:
        print(f"lmctl: {message}", file=sys.stderr)
    return exit_code


def _fail(term: Terminal, code: str, message: str) -> None:
    raise typer.Exit(report(term.json, code, message))


def run(term: Terminal, fn: Callable[[], None]) -> None:
    """Run a command body, mapping every failure to one line and its exit code."""
    try:
        fn()
    except typer.Exit:
        raise
    except Unreachable as exc:
        _fail(term, "unreachable", str(exc))
    except RemoteError as exc:
        _fail(term, exc.code, str(exc))
    except CommandError as exc:
        _fail(term, exc.code, str(exc))
    except KeyboardInterrupt:
        if term.client is not None:
            term.client.close()
            term.client = None
        _fail(term, "interrupted", "interrupted; the daemon cancels the job (changes made so far stay)")
    except Exception as exc:  # a bug: still one line, never a traceback
        _fail(term, "failed", f"internal error: {type(exc).__name__}: {exc}")


def chunk_id(key_hex: str) -> str:
    """The part of a key that tells chunks apart: its chunk hash (the first 32 hex digits
    are the namespace, the same for every chunk of a model and adapter)."""
    return key_hex[32:48] + "…"


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _console() -> Any:
    from rich.console import Console

    # lines are never broken inside a value; piped output gets room for wide tables
    return Console(highlight=False, soft_wrap=True, width=None if sys.stdout.isatty() else 200)


def _table(title: str | None, cols: list[str], rows: list[list[str]], right: set[str] | None = None) -> None:
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="right" if right and c in right else "left")
    for r in rows:
        t.add_row(*r)
    _console().print(t)


def _emit(term: Terminal, result: dict[str, Any], human_out: Callable[[dict[str, Any]], None]) -> None:
    if term.json:
        print(json.dumps(result))
    else:
        human_out(result)


# -- the app and its global options ------------------------------------------------------
app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
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
    if version:
        print(__version__)
        raise typer.Exit(0)
    term = ctx.obj if isinstance(ctx.obj, Terminal) else Terminal()
    if socket_path:
        term.socket = socket_path
        term.socket_given = True
    term.json = term.json or as_json
    ctx.obj = term


def _term(ctx: typer.Context) -> Terminal:
    obj = ctx.find_root().obj
    assert isinstance(obj, Terminal)
    return obj


# -- selectors, declared once --------------------------------------------------------------
def _complete_names(kind: str) -> Callable[[str], list[str]]:
    def complete(incomplete: str) -> list[str]:
        try:
            names = Client(default_socket(), timeout=2).call("names")
        except Exception:
            return []
        return [n for n in names.get(kind, []) if n.startswith(incomplete)]

    return complete


SELECTORS: list[inspect.Parameter] = [
    inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=ann)
    for name, default, ann in [
        ("key", None, Annotated[list[str] | None, typer.Option(
            "--key", help="a chunk key (96 hex digits); repeatable", rich_help_panel="Selectors")]),
        ("model", None, Annotated[str | None, typer.Option(
            help="model id as the engine serves it", autocompletion=_complete_names("models"),
            rich_help_panel="Selectors")]),
        ("adapter", None, Annotated[str | None, typer.Option(
            help="LoRA adapter: NAME (newest served), NAME@DIGEST or its folder",
            autocompletion=_complete_names("adapters"), rich_help_panel="Selectors")]),
        ("base", False, Annotated[bool, typer.Option(
            "--base", help="the base model only (no adapter)", rich_help_panel="Selectors")]),
        ("label", None, Annotated[list[str] | None, typer.Option(
            help="chunks pinned under this label (pin/unpin: the pin's label)",
            autocompletion=_complete_names("labels"), rich_help_panel="Selectors")]),
        ("tier", None, Annotated[str | None, typer.Option(
            help="dram, nvme or remote", rich_help_panel="Selectors")]),
        ("older_than", None, Annotated[str | None, typer.Option(
            help="not used for this long (90s, 30m, 12h, 7d)", rich_help_panel="Selectors")]),
        ("pinned", None, Annotated[bool | None, typer.Option(
            "--pinned/--unpinned", help="only pinned / only unpinned chunks", rich_help_panel="Selectors")]),
        ("text", None, Annotated[str | None, typer.Option(
            help="a document given inline", rich_help_panel="Documents")]),
        ("file", None, Annotated[str | None, typer.Option(
            help="a document in a text file ('-' for stdin)", rich_help_panel="Documents")]),
        ("tokens", None, Annotated[str | None, typer.Option(
            help="a JSON file with a list of token ids", rich_help_panel="Documents")]),
        ("messages", None, Annotated[str | None, typer.Option(
            help="a JSON file of chat messages, rendered with the model's chat template",
            rich_help_panel="Documents")]),
        ("tokenizer", None, Annotated[str | None, typer.Option(
            help="tokenizer folder or id [default: the one the engine recorded]", rich_help_panel="Documents")]),
        ("salt", None, Annotated[str | None, typer.Option(
            "--cache-salt", help="the requests' cache_salt", rich_help_panel="Documents")]),
    ]
]
SELECTOR_NAMES = [p.name for p in SELECTORS]


def _read(path: str, what: str) -> str:
    try:
        if path == "-":
            return sys.stdin.read()
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError as exc:
        raise CommandError("usage", f"cannot read {what} {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise CommandError("usage", f"{what} {path} is not UTF-8 text (a binary file?)") from None


def adapter_spec(a: str) -> str:
    """``--adapter``: a name stays a name (even if a folder of that name is here); only a
    path (it has a slash) is a folder, sent to the daemon as an absolute path."""
    if os.sep in a or a in (".", "..") or a.startswith("~"):
        return os.path.abspath(os.path.expanduser(a))
    return a


def build_selector(v: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if v.get("key"):
        out["keys"] = list(v["key"])
    labels = v.get("label") or []
    if len(labels) > 1:
        raise CommandError("usage", f"give one --label, not {len(labels)} ({', '.join(labels)})")
    if labels:
        out["label"] = labels[0]
    for k in ("model", "tier", "tokenizer", "salt"):
        if v.get(k) is not None:
            out[k] = v[k]
    if v.get("base") and v.get("adapter") is not None:
        raise CommandError("usage", "--base and --adapter contradict each other: give one")
    if v.get("adapter") is not None:
        out["adapter"] = adapter_spec(v["adapter"])
    if v.get("base"):
        out["base"] = True
    if v.get("pinned") is not None:
        out["pinned"] = v["pinned"]
    if v.get("older_than") is not None:
        try:
            out["older_than"] = parse_duration(v["older_than"])
        except ValueError as exc:
            raise CommandError("usage", str(exc)) from None
    docs = [k for k in ("text", "file", "tokens", "messages") if v.get(k) is not None]
    if len(docs) > 1:
        raise CommandError("usage", "give one document: --text, --file, --tokens or --messages")
    if docs:
        kind = docs[0]
        if kind == "text":
            out["doc"] = {"text": v["text"]}
        elif kind == "file":
            out["doc"] = {"text": _read(v["file"], "document")}
        else:
            raw = _read(v[kind], "--" + kind)
            try:
                out["doc"] = {kind: json.loads(raw)}
            except ValueError:
                raise CommandError("usage", f"--{kind} {v[kind]} is not valid JSON") from None
    return out


def with_selectors(fn: Callable[..., None]) -> Callable[..., None]:
    """Add the shared selector options to a command; it receives them as ``sel``."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "sel"] + SELECTORS

    @functools.wraps(fn)
    def wrapper(**kw: Any) -> None:
        raw = {k: kw.pop(k) for k in SELECTOR_NAMES}
        term = _term(kw["ctx"])
        sel: dict[str, Any] = {}

        def build() -> None:
            sel.update(build_selector(raw))

        run(term, build)
        fn(sel=sel, **kw)

    wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in params}
    return wrapper


DryRun = Annotated[bool, typer.Option("--dry-run", help="show what would change; change nothing")]


# -- commands ---------------------------------------------------------------------------------
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
    set_: Annotated[list[str] | None, typer.Option(
        "--set", help="any store setting, KEY=VALUE (see lmctl config show); repeatable")] = None,
    log_level: Annotated[str | None, typer.Option(help="debug, info, warning or error [default: info]")] = None,
) -> None:
    """Run the daemon in the foreground (logs to stderr; SIGTERM or Ctrl-C stops it)."""
    import logging

    from store import StoreError

    from .daemon import Daemon, socket_access
    from .errors import UsageError
    from .settings import serve_settings

    term = _term(ctx)

    def body() -> None:
        try:
            daemon, changes = serve_settings(config, capacity=capacity, tier_path=tier_path, pin_budget=pin_budget,
                                             codec=codec, codec_level=codec_level, settings=set_)
        except UsageError as exc:
            raise CommandError("usage", str(exc)) from None
        store_dir = store or daemon.get("store")
        if not store_dir:
            raise CommandError("usage", "give --store DIR (or $LMCTL_STORE, or store in the config file's [daemon])")
        # the socket: serve's --socket, else the global --socket / $LMCTL_SOCKET, else the file's
        sock = socket_path or (term.socket if term.socket_given or os.environ.get("LMCTL_SOCKET") else None)
        sock = sock or daemon.get("socket")
        level = (log_level or daemon.get("log_level") or "info").upper()
        if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise CommandError("usage", f"--log-level must be debug, info, warning or error, not {level.lower()!r}")
        interval = maintenance_interval if maintenance_interval is not None else daemon.get("maintenance_interval", 30)
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not interval > 0:
            raise CommandError("usage", f"--maintenance-interval must be a positive number of seconds, not {interval}")
        uids = list(allow_uid or daemon.get("allow_uid") or [])
        try:
            mode, gid = socket_access(socket_mode or daemon.get("socket_mode") or "0600",
                                      socket_group or daemon.get("socket_group"))
        except UsageError as exc:
            raise CommandError("usage", str(exc)) from None
        logging.basicConfig(stream=sys.stderr, level=getattr(logging, level),
                            format="%(asctime)s lmctl[%(process)d] %(levelname)s %(message)s")
        try:
            d = Daemon(store_dir, sock, uids, float(interval), socket_mode=mode, socket_group=gid, init=init,
                       settings=changes)
            clean = d.serve()
        except UsageError as exc:
            raise CommandError("usage", str(exc)) from None
        except StoreError as exc:
            raise CommandError("failed", str(exc)) from None
        raise typer.Exit(int(Exit.OK if clean else Exit.FAILED))

    run(term, body)


@app.command()
def status(ctx: typer.Context) -> None:
    """Daemon and store health: tiers, usage, capacity, running jobs."""
    term = _term(ctx)

    def body() -> None:
        r = term.call("status")

        def show(r: dict[str, Any]) -> None:
            d = r["daemon"]
            c = _console()
            c.print(f"lmctl {d['version']} serving [bold]{r['store']['path']}[/bold] on {d['socket']} "
                    f"(pid {d['pid']}, up {d['uptime_s']:.0f} s, {d['clients']} client(s))")
            _tiers(r["store"]["tiers"])
            k = r["store"]["counters"]
            c.print(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}  "
                    f"write amplification {r['store']['write_amplification']:.4f}")
            for j in r["jobs"]:
                c.print(f"job {j['id']}: {j['cmd']} {j['what']} {j['done']}/{j['total']}")

        _emit(term, r, show)

    run(term, body)


def _tiers(tiers: dict[str, Any]) -> None:
    rows = []
    for name, v in tiers.items():
        cap = v["capacity"]
        rows.append([name, str(v["chunks"]), human(v["bytes"]), human(cap),
                     f"{100 * v.get('disk_bytes', v['bytes']) / cap:.1f}%" if cap else "-",
                     human(v.get("pinned_bytes", 0))])
    _table(None, ["tier", "chunks", "bytes", "capacity", "used", "pinned"], rows,
           {"chunks", "bytes", "capacity", "used", "pinned"})


@app.command()
@with_selectors
def lookup(ctx: typer.Context, sel: dict[str, Any]) -> None:
    """How much of a document is cached: hit tokens, chunks per tier, first miss."""
    term = _term(ctx)

    def body() -> None:
        r = term.call("lookup", sel)

        def show(r: dict[str, Any]) -> None:
            c = _console()
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
            _table(None, ["chunk", "chunk hash", "tier"], rows)

        _emit(term, r, show)

    run(term, body)


@app.command()
@with_selectors
def pin(ctx: typer.Context, sel: dict[str, Any], dry_run: DryRun = False) -> None:
    """Pin chunks or a document under --label (durable; never evicted). Works before it is served."""
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
    sel = {**sel, "force": force}
    _mutate(ctx, "evict", sel, dry_run, lambda r: (
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
    def line(r: dict[str, Any]) -> str:
        saved = r["bytes_saved"]
        change = f"saved {human(saved)}" if saved >= 0 else f"grew by {human(-saved)}"
        skipped = f"; {r['skipped']} already {r['codec']} at that level" if r["skipped"] else ""
        if r["dry_run"]:
            return (f"would recompress {r['chunks']} chunk(s): {human(r['bytes_before'])} -> about "
                    f"{human(r['bytes_after'])} (estimated), {change}{skipped}")
        return (f"recompressed {r['chunks']} chunk(s): {human(r['bytes_before'])} -> {human(r['bytes_after'])}, "
                f"{change}{skipped}")

    _mutate(ctx, "compress", {**sel, "level": level, "codec": codec}, dry_run, line, long=True)


def _mutate(ctx: typer.Context, cmd: str, sel: dict[str, Any], dry_run: bool,
            line: Callable[[dict[str, Any]], str], long: bool = False) -> None:
    term = _term(ctx)

    def body() -> None:
        r = term.call(cmd, {**sel, "dry_run": dry_run}, long=long)
        _emit(term, r, lambda r: _console().print(line(r)))

    run(term, body)


@app.command("inspect")
def inspect_(ctx: typer.Context, key: Annotated[str | None, typer.Option(
        help="one chunk's metadata")] = None) -> None:
    """Store statistics by tier, model, adapter and label, or one chunk's metadata."""
    term = _term(ctx)

    def body() -> None:
        r = term.call("inspect", {"key": key} if key else {})

        def show(r: dict[str, Any]) -> None:
            if "chunk" in r:
                ch = r["chunk"]
                _table(None, ["field", "value"], [[k, json.dumps(v) if not isinstance(v, str) else v]
                                                  for k, v in ch.items()])
                return
            c = _console()
            c.print(f"{r['chunks']} chunks, {human(r['bytes'])}; write amplification {r['write_amplification']:.4f}")
            _tiers(r["tiers"])
            if r["models"]:
                import time as _time

                _table("models (one row per checkpoint fingerprint)",
                       ["model", "fingerprint", "last used", "chunks", "bytes"],
                       [[m["model"], (m["fingerprint"] or "-")[:12] + (" (retired)" if m["retired"] else ""),
                         _time.strftime("%Y-%m-%d %H:%M", _time.localtime(m["last_used"])) if m["last_used"] else "-",
                         str(m["chunks"]), human(m["bytes"])] for m in r["models"]], {"chunks", "bytes"})
            if r["adapters"]:
                _table("by model and adapter", ["model", "adapter", "chunks", "bytes"],
                       [[a["model"], a["adapter"] or "(base)", str(a["chunks"]), human(a["bytes"])]
                        for a in r["adapters"]], {"chunks", "bytes"})
            if r["labels"]:
                _table("labels", ["label", "chunks"], [[k, str(v)] for k, v in r["labels"].items()], {"chunks"})
            k = r["counters"]
            c.print(f"hits {k['hits']}  misses {k['misses']}  corrupt {k['corrupt']}  evicted {k['evicted']}")

        _emit(term, r, show)

    run(term, body)


@app.command("ls")
@with_selectors
def ls_(ctx: typer.Context, sel: dict[str, Any], limit: Annotated[int, typer.Option(
        help="rows to list (0: all)", min=0)] = 100) -> None:
    """List chunks matching a selector (all chunks without one)."""
    term = _term(ctx)

    def body() -> None:
        r = term.call("ls", {**sel, "limit": limit})

        def show(r: dict[str, Any]) -> None:
            rows = [[chunk_id(x["key"]), x["tier"], human(x["bytes"]), str(x["tokens"]), str(x["pins"]),
                     str(x["hits"]), x["adapter"] or "(base)"] for x in r["chunks"]]
            _table(None, ["chunk hash", "tier", "bytes", "tokens", "pins", "hits", "adapter"], rows,
                   {"bytes", "tokens", "pins", "hits"})
            more = f" (showing {len(r['chunks'])})" if r["truncated"] else ""
            _console().print(f"{r['total']} chunk(s), {human(r['bytes'])}{more}")

        _emit(term, r, show)

    run(term, body)


@app.command()
@with_selectors
def warm(ctx: typer.Context, sel: dict[str, Any], endpoint: Annotated[str | None, typer.Option(
        help="also prefill the document through this OpenAI-compatible server (http://host:port)")] = None,
         dry_run: DryRun = False) -> None:
    """Before a restart or traffic shift: promote chunks to dram; --endpoint prefills missing ones."""
    term = _term(ctx)

    def body() -> None:
        out: dict[str, Any] = {}
        if endpoint:
            base = endpoint_base(endpoint)
            if "doc" not in sel:
                raise CommandError("usage", "--endpoint needs a document (--text, --file, --tokens or --messages)")
            known = term.call("names")["models"]
            if sel.get("model") is None:
                if len(known) != 1:
                    raise CommandError("usage", "give --model: the name the engine serves the model under")
                sel["model"] = known[0]
            if sel["model"] in known:
                before = term.call("lookup", sel)  # also checks the document before anything is sent
            else:  # an engine that has not recorded the model yet: the prefill makes it do so
                before = {"hit_tokens": 0, "total_tokens": 0, "first_miss": 0}
            out["prefill"] = {"endpoint": base, "hit_tokens_before": before["hit_tokens"]}
            after = before
            if not dry_run and before.get("first_miss") is not None:
                _prefill(base, sel)
                after = _settled_lookup(term, sel)
            out["prefill"]["hit_tokens_after"] = after["hit_tokens"]
            out["prefill"]["total_tokens"] = after["total_tokens"]
            if "dram" not in term.call("status")["store"]["tiers"]:
                # prefill only: the chunks stay where the engine wrote them
                out.update({"chunks": 0, "bytes": 0, "bytes_before": 0, "bytes_after": 0, "skipped": 0,
                            "missing": 0, "dry_run": dry_run, "to": None})
        if "to" not in out:
            out.update(term.call("warm", {**sel, "dry_run": dry_run}, long=True))

        def show(r: dict[str, Any]) -> None:
            c = _console()
            if "prefill" in r:
                p = r["prefill"]
                c.print(f"prefill: {p['hit_tokens_before']} -> {p['hit_tokens_after']} of {p['total_tokens']} "
                        "tokens cached")
            if r["to"] is None:
                c.print("no dram tier in this store: the chunks stay where the engine wrote them")
            else:
                c.print(f"{'would promote' if r['dry_run'] else 'promoted'} {r['chunks']} chunk(s), "
                        f"{human(r['bytes'])} to dram")

        _emit(term, {k: out[k] for k in sorted(out, key=list(WARM_KEYS).index)}, show)

    run(term, body)


WARM_KEYS = ("chunks", "bytes", "bytes_before", "bytes_after", "skipped", "missing", "dry_run", "to", "prefill")


def endpoint_base(url: str) -> str:
    """The server's root from ``--endpoint``: ``http://host:port``, with or without ``/v1``."""
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        _ = u.port
    except ValueError:
        u = None  # type: ignore[assignment]
    if u is None or u.scheme not in ("http", "https") or not u.hostname:
        raise CommandError("usage", f"--endpoint {url!r} is not a URL like http://host:8000 (the engine's "
                                    "OpenAI-compatible server)")
    path = u.path.rstrip("/")
    if path.endswith("/v1"):
        path = path[:-3]
    return f"{u.scheme}://{u.netloc}{path}"


def _settled_lookup(term: Terminal, sel: dict[str, Any], timeout: float = 15.0) -> dict[str, Any]:
    """Look the document up until the engine's background saves have landed: every full
    chunk cached, or no change for a second, or ``timeout``."""
    import time

    end = time.monotonic() + timeout
    last, still_since = -1, time.monotonic()
    while True:
        r = term.call("lookup", sel)
        full = r["total_tokens"] // r["chunk_size"] * r["chunk_size"] if r.get("chunk_size") else 0
        if r["hit_tokens"] != last:
            last, still_since = r["hit_tokens"], time.monotonic()
        if r["hit_tokens"] >= full or time.monotonic() - still_since > 1.0 or time.monotonic() > end:
            return r
        time.sleep(0.1)


def _prefill(endpoint: str, sel: dict[str, Any]) -> None:
    """Send the document once through the engine (one output token) so it stores the KV."""
    import urllib.error
    import urllib.request

    doc = sel["doc"]
    body: dict[str, Any] = {"model": sel.get("model"), "max_tokens": 1, "temperature": 0}
    if "messages" in doc:
        url, body["messages"] = endpoint + "/v1/chat/completions", doc["messages"]
    elif "tokens" in doc:
        url, body["prompt"] = endpoint + "/v1/completions", doc["tokens"]
    else:
        url, body["prompt"] = endpoint + "/v1/completions", doc["text"]
    if sel.get("adapter") and "@" not in sel["adapter"] and os.sep not in sel["adapter"]:
        body["model"] = sel["adapter"]  # vLLM serves a LoRA adapter under its name
    if sel.get("salt"):
        body["cache_salt"] = sel["salt"]
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as resp:
            resp.read()
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise CommandError("failed", f"prefill through {url} failed: {exc}") from None


@app.command()
def verify(ctx: typer.Context, deep: Annotated[bool, typer.Option(help="read and checksum every payload")] = False,
           fix: Annotated[bool, typer.Option(help="repair what is found")] = False) -> None:
    """Check index/segment consistency (and checksums with --deep); --fix repairs."""
    term = _term(ctx)

    def body() -> None:
        r = term.call("verify", {"deep": deep, "fix": fix}, long=True)

        def show(r: dict[str, Any]) -> None:
            for p in r["problems"]:
                print(f"{'fixed' if p['fixed'] else 'found'}: {p['kind']}: {p['detail']}")
            left = sum(1 for p in r["problems"] if not p["fixed"])
            # what --deep found (bad payloads) only a deep pass can fix
            again = "lmctl verify --deep --fix" if r["deep"] else "lmctl verify --fix"
            print("ok" if not left else f"{left} problem(s) left; run {again}")

        _emit(term, r, show)
        if not r["ok"]:
            raise typer.Exit(int(Exit.FAILED))

    run(term, body)


@app.command()
def shell(ctx: typer.Context) -> None:
    """An interactive session over one connection: history, tab completion, help."""
    from .shell import Shell

    term = _term(ctx)
    term.keep_open = True
    Shell(app, term, invoke, report).loop()


completion_app = typer.Typer(help="Shell completion scripts (bash, zsh, fish).", no_args_is_help=True)
app.add_typer(completion_app, name="completion")
SHELLS = ("bash", "zsh", "fish")


def completion_script(shell_name: str) -> str:
    """The script for a shell, generated by typer from this app (it calls back into
    ``lmctl`` with ``_LMCTL_COMPLETE`` set, so completions follow the installed CLI)."""
    from typer._completion_classes import completion_init
    from typer._completion_shared import get_completion_script

    if shell_name not in SHELLS:
        raise CommandError("usage", f"unknown shell {shell_name!r}; choose bash, zsh or fish")
    completion_init()
    return get_completion_script(prog_name="lmctl", complete_var="_LMCTL_COMPLETE", shell=shell_name) + "\n"


@completion_app.command("show")
def completion_show(shell_name: Annotated[str, typer.Argument(metavar="SHELL", help="bash, zsh or fish")]) -> None:
    """Print the completion script for a shell."""
    run(Terminal(), lambda: print(completion_script(shell_name), end=""))


def completion_target(shell_name: str, home: str) -> str:
    return {
        "bash": os.path.join(home, ".local/share/bash-completion/completions/lmctl"),
        "zsh": os.path.join(home, ".zfunc/_lmctl"),
        "fish": os.path.join(home, ".config/fish/completions/lmctl.fish"),
    }[shell_name]


config_app = typer.Typer(help="Show or change the store's settings through the daemon.", no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show")
def config_show(ctx: typer.Context) -> None:
    """The store's settings (tiers, capacities, pin budgets, codec, ...)."""
    term = _term(ctx)

    def body() -> None:
        r = term.call("config")
        _emit(term, r, _show_settings)

    run(term, body)


def _show_settings(r: dict[str, Any]) -> None:
    cfg = r["settings"]
    rows = [[k, json.dumps(v) if not isinstance(v, str) else v] for k, v in cfg.items() if k != "tiers"]
    for name, t in cfg["tiers"].items():
        rows += [[f"tiers.{name}.{k}", json.dumps(v) if not isinstance(v, str) else v] for k, v in t.items()]
    _table(None, ["setting", "value"], rows)
    if r.get("changed"):
        _console().print("changed: " + ", ".join(r["changed"]))


@config_app.command("set")
def config_set(ctx: typer.Context, pairs: Annotated[list[str], typer.Argument(
        metavar="KEY=VALUE...", help="e.g. tiers.nvme.capacity=500GiB codec=zstd-shuffle")]) -> None:
    """Change store settings (validated, recorded in the store, applied at once)."""
    term = _term(ctx)

    def body() -> None:
        changes: dict[str, Any] = {}
        for p in pairs:
            k, sep, v = p.partition("=")
            if not sep or not k.strip():
                raise CommandError("usage", f"{p!r} is not KEY=VALUE (e.g. tiers.nvme.capacity=500GiB)")
            changes[k.strip()] = v.strip()
        r = term.call("config", {"set": changes})
        _emit(term, r, _show_settings)

    run(term, body)


@completion_app.command("install")
def completion_install(shell_name: Annotated[str | None, typer.Option(
        "--shell", help="bash, zsh or fish [default: from $SHELL]")] = None) -> None:
    """Install the completion script where the shell finds it (in your home folder)."""
    term = Terminal()

    def body() -> None:
        name = shell_name or os.path.basename(os.environ.get("SHELL", "bash"))
        if name not in SHELLS:
            raise CommandError("usage", f"cannot tell the shell from {name!r}; pass --shell bash|zsh|fish")
        path = completion_target(name, os.path.expanduser("~"))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(completion_script(name))
        print(f"installed {name} completion to {path}")
        if name == "zsh":
            print("add to ~/.zshrc (before compinit): fpath=(~/.zfunc $fpath)")
        if name == "bash":
            note = bash_completion_note(path)
            if note:
                print(note)

    run(term, body)


#: where distributions put the bash-completion framework, which loads per-user scripts
BASH_COMPLETION = ("/usr/share/bash-completion/bash_completion", "/etc/bash_completion")


def bash_completion_note(script: str, framework: tuple[str, ...] = BASH_COMPLETION) -> str | None:
    """How to load the script when bash-completion (which would load it on demand) is absent."""
    if any(os.path.exists(p) for p in framework):
        return None
    return (f"bash-completion is not installed here, so bash will not load {script} by itself: "
            f"install the bash-completion package, or add this line to ~/.bashrc: source {script}")


def reference_markdown() -> str:
    """The command reference for docs/cli.md, generated from the app (a test keeps them equal)."""
    root: Any = typer.main.get_command(app)
    out = ["| command | options |", "|---|---|"]

    def walk(prefix: str, group: Any) -> None:
        for name, cmd in group.commands.items():
            full = f"{prefix} {name}".strip()
            if hasattr(cmd, "commands"):
                walk(full, cmd)
                continue
            opts = []
            names = {p.name for p in cmd.params}
            shared = set(SELECTOR_NAMES) <= names
            for p in cmd.params:
                if shared and p.name in SELECTOR_NAMES:
                    continue
                if getattr(p, "param_type_name", "") == "option":
                    flags = "/".join(list(p.opts) + list(p.secondary_opts))
                    opts.append(f"`{flags}`" + (" (required)" if p.required else ""))
                elif getattr(p, "param_type_name", "") == "argument":
                    opts.append(f"`{(p.metavar or p.name).upper()}`")
            if shared:
                opts.append("[selectors](#selectors)")
            summary = (cmd.help or "").strip().splitlines()[0] if cmd.help else ""
            out.append(f"| `lmctl {full}`: {summary} | {', '.join(opts)} |")

    walk("", root)
    return "\n".join(out) + "\n"


# -- entry point ---------------------------------------------------------------------------
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


def main(argv: list[str] | None = None) -> None:
    args = hoist_globals(list(sys.argv[1:] if argv is None else argv))
    if os.environ.get("_LMCTL_COMPLETE"):  # a completion script is asking
        from typer._completion_classes import completion_init

        completion_init()
        app(args=list(sys.argv[1:]), prog_name="lmctl")
        return
    sys.exit(invoke(args, Terminal(json="--json" in args[: args.index("--")] if "--" in args else "--json" in args)))


def invoke(args: list[str], term: Terminal) -> int:
    """Run one command line; returns its exit code. Option parsing errors follow the same
    rule as every other error: one line, or the JSON error object under --json."""
    from typer import _click as click  # typer's own click (typer >= 0.25 vendors it)

    words = args[: args.index("--")] if "--" in args else args
    if "--pinned" in words and "--unpinned" in words:
        return report(term.json, "usage", "--pinned and --unpinned contradict each other: give one")
    cmd = typer.main.get_command(app)
    try:
        rv = cmd.main(args=args, prog_name="lmctl", standalone_mode=False, obj=term)
    except click.exceptions.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else "lmctl"
        return report(term.json, "usage", f"{exc.format_message()} (see {where} --help)")
    except typer.Abort:
        return report(term.json, "interrupted", "interrupted")
    except typer.Exit as exc:
        return int(exc.exit_code)
    except click.ClickException as exc:
        return report(term.json, "usage", exc.format_message())
    return int(rv) if isinstance(rv, int) else 0


if __name__ == "__main__":
    main()
