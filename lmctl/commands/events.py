"""``lmctl events``: the store's event log, once or followed."""

import json
import time
from typing import Annotated, Any

import typer

from ..completion import complete_values
from ..terminal import CommandError, ExitStatus, Terminal, human, printable
from .base import NoHeaders, Output, chunk_id, formats, iso_time, keys_only, local_time, request


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
    from ..units import parse_duration

    term = formats(ctx, output, no_headers)

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
        request(ctx, "events", args, _show_events)
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
