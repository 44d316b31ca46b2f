"""``lmctl status`` (and ``--check``, the probe) and ``lmctl verify``: the daemon's and the store's health."""

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from ..endurance import endurance_lines
from ..terminal import ExitStatus, Terminal, printable
from .base import request, tiers_table, write_amplification


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
            request(ctx, "status", {}, _show_status)
        return
    _check(Terminal.of(ctx), 10.0 if timeout is None else timeout)


@contextmanager
def _deadline(term: Terminal, timeout: float | None) -> Iterator[None]:
    """Requests made meanwhile give up after ``timeout`` seconds without an answer (None:
    as the terminal's connection already does)."""
    if timeout is None:
        yield
        return
    from ..client import Client

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
    from ..terminal import classify

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
    tiers_table(term, r["store"]["tiers"])
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
    for line in endurance_lines(r["store"]):
        term.say(line)
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
    from ..health import describe_pass

    line = f"maintenance: {every}, last pass {_utc(m['last_ok_at'])} ({describe_pass(m.get('last_ok') or {})})"
    if m.get("failures_total"):
        line += (f"; {m['failures_total']} failed pass(es) since the daemon started, the last at "
                 f"{_utc(m['last_error_at'])}: {m['last_error']}")
    return line


def verify(ctx: typer.Context, deep: Annotated[bool, typer.Option(help="read and checksum every payload")] = False,
           fix: Annotated[bool, typer.Option(help="repair what is found")] = False) -> None:
    """Check index/segment consistency (and checksums with --deep); --fix repairs.

    \b
    Examples:
      lmctl verify
      lmctl verify --deep --fix
    """
    request(ctx, "verify", {"deep": deep, "fix": fix}, _show_verify, long=True, ok=lambda r: r["ok"])


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
