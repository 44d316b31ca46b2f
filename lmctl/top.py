"""``lmctl top``: a live view of the store through the daemon, refreshed in place.

Each refresh asks the daemon for ``metrics`` (its status and the store's metric cells, which
every process using the store adds to) and shows rates over the last interval next to the
totals: engine hit rate per model and adapter, loads and saves per tier, remote tier traffic,
tier usage, engine processes' save queues and loads in flight, and the daemon's running
jobs. ``q`` (or Ctrl-C) quits. Where stdout is not a terminal it prints ``--iterations``
frames one after the other (one by default).
"""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .terminal import human, printable

Snapshot = dict[str, Any]


#: engine gauges (by pid) -> their field in the view's ``queues``
QUEUE_GAUGES = {"engine_save_queue": "save_queue", "engine_loads_in_flight": "loads_in_flight"}


def _total(snap: Snapshot, name: str, field: str = "value", **match: str) -> float:
    """The sum of ``field`` over the snapshot's cells of ``name`` whose labels include ``match``."""
    return sum(c[field] for c in snap.get("cells", [])
               if c["name"] == name and all(c["labels"].get(k) == v for k, v in match.items()))


def rates(prev: Snapshot | None, cur: Snapshot) -> dict[str, Any]:
    """What the view shows, as numbers (``--json`` prints this): totals, and per-second rates
    over the interval between ``prev`` and ``cur`` (None for the first frame)."""
    dt = None if prev is None else max(1e-6, cur["time"] - prev["time"])

    def rate(name: str, field: str = "value", **match: str) -> float | None:
        if prev is None or dt is None:
            return None
        return max(0.0, _total(cur, name, field, **match) - _total(prev, name, field, **match)) / dt

    who = sorted({(c["labels"].get("model", ""), c["labels"].get("adapter", ""))
                  for c in cur.get("cells", []) if c["name"] == "lookups_total"})
    engines = []
    for model, adapter in who:
        hit = _total(cur, "lookup_hit_tokens_total", model=model, adapter=adapter)
        miss = _total(cur, "lookup_miss_tokens_total", model=model, adapter=adapter)
        row: dict[str, Any] = {"model": model, "adapter": adapter or None,
                               "lookups": int(_total(cur, "lookups_total", model=model, adapter=adapter)),
                               "hit_rate": hit / (hit + miss) if hit + miss else None, "hit_rate_now": None}
        if prev is not None:
            dh = hit - _total(prev, "lookup_hit_tokens_total", model=model, adapter=adapter)
            dm = miss - _total(prev, "lookup_miss_tokens_total", model=model, adapter=adapter)
            row["hit_rate_now"] = dh / (dh + dm) if dh + dm > 0 else None
        engines.append(row)
    status = cur["status"]
    tiers = {}
    for name, t in status["store"]["tiers"].items():
        tiers[name] = {"chunks": t["chunks"], "bytes": t["bytes"], "capacity": t["capacity"],
                       "pinned_bytes": t["pinned_bytes"],
                       "load_bytes_per_s": rate("load_bytes_total", tier=name),
                       "save_bytes_per_s": rate("save_bytes_total", tier=name),
                       "loads_per_s": rate("loads_total", tier=name), "saves_per_s": rate("saves_total", tier=name)}
    remote_reads = _total(cur, "load_bytes_total", tier="remote")
    queues: dict[str, dict[str, int]] = {}
    for g in cur.get("gauges", []):
        if g["name"] in QUEUE_GAUGES:
            row = queues.setdefault(g["labels"].get("pid", "?"), dict.fromkeys(QUEUE_GAUGES.values(), 0))
            row[QUEUE_GAUGES[g["name"]]] = int(g["value"])
    out: dict[str, Any] = {"time": cur["time"], "interval_s": dt, "engines": engines, "tiers": tiers,
                           "queues": dict(sorted(queues.items())), "remote_load_bytes": remote_reads,
                           "jobs": status["jobs"], "counters": status["store"]["counters"]}
    rm = status["store"].get("remote")
    if rm:
        out["remote"] = {"url": rm["url"], "breaker": rm["breaker"],
                         "bytes_in_per_s": rate("remote_bytes_total", direction="in"),
                         "bytes_out_per_s": rate("remote_bytes_total", direction="out"),
                         "errors_per_s": rate("remote_errors_total"),
                         "errors": _total(cur, "remote_errors_total")}
    return out


def render(view: dict[str, Any], live: bool = True) -> Any:
    """The frame for ``view`` (from ``rates``) as a rich renderable (``live``: refreshed in
    place, where ``q`` quits)."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    def per_s(x: float | None) -> str:
        return "-" if x is None else f"{human(x)}/s"

    def text(s: str) -> Text:  # a name is text, never markup, and prints no control character
        return Text(printable(s))

    parts: list[Any] = [Text(time.strftime("lmctl top  %H:%M:%S", time.localtime(view["time"]))
                             + ("   q quits" if live else ""), style="bold")]
    eng = Table(title="engine lookups (every process using the store)", title_justify="left", expand=False)
    for col in ("model", "adapter", "lookups", "hit rate", "hit rate now"):
        eng.add_column(col, justify="right" if col not in ("model", "adapter") else "left")
    for e in view["engines"]:
        eng.add_row(text(e["model"][-40:]), text(e["adapter"] or "(base)"), str(e["lookups"]), pct(e["hit_rate"]),
                    pct(e["hit_rate_now"]))
    if not view["engines"]:
        eng.add_row("(no engine lookups yet)", "", "", "", "")
    parts.append(eng)
    tiers = Table(title="tiers", title_justify="left")
    for col in ("tier", "chunks", "bytes", "capacity", "pinned", "loads", "loaded", "saves", "saved"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in view["tiers"].items():
        tiers.add_row(name, str(t["chunks"]), human(t["bytes"]), human(t["capacity"]),
                      human(t["pinned_bytes"]), "-" if t["loads_per_s"] is None else f"{t['loads_per_s']:.1f}/s",
                      per_s(t["load_bytes_per_s"]),
                      "-" if t["saves_per_s"] is None else f"{t['saves_per_s']:.1f}/s", per_s(t["save_bytes_per_s"]))
    parts.append(tiers)
    rm = view.get("remote")
    if rm:
        parts.append(text(f"remote {rm['url']}: breaker {rm['breaker']}, in {per_s(rm['bytes_in_per_s'])}, "
                          f"out {per_s(rm['bytes_out_per_s'])}, errors {rm['errors']:.0f}"))
    k = view["counters"]
    parts.append(Text(f"corrupt {k.get('corrupt', 0)}  evicted {k.get('evicted', 0)}  "
                      f"rejected (full) {k.get('rejected_full', 0)}"))
    if view["queues"]:
        q = Table(title="engine queues (processes that reported in the last minute)", title_justify="left")
        for col in ("pid", "saves queued", "loads in flight"):
            q.add_column(col, justify="right")
        for pid, v in view["queues"].items():
            q.add_row(pid, str(v["save_queue"]), str(v["loads_in_flight"]))
        parts.append(q)
    if view["jobs"]:
        jobs = Table(title="daemon jobs", title_justify="left")
        for col in ("id", "command", "progress", "running"):
            jobs.add_column(col)
        for j in view["jobs"]:
            jobs.add_row(str(j["id"]), text(f"{j['cmd']} {j['what']}".strip()),
                         f"{j['done']}/{j['total']}" if j["total"] else str(j["done"]), f"{j['running_s']:.0f} s")
        parts.append(jobs)
    else:
        parts.append(Text("daemon jobs: none running"))
    return Group(*parts)


@contextmanager
def _keys(stream: Any) -> Iterator[Callable[[float], str]]:
    """Single key presses from a terminal (cbreak mode), restored at the end; elsewhere a
    reader that only waits."""
    try:
        fd = stream.fileno()
        interactive = os.isatty(fd)
    except (AttributeError, OSError, ValueError):
        interactive = False
    if not interactive:
        def wait(timeout: float) -> str:
            time.sleep(timeout)
            return ""

        yield wait
        return
    import termios
    import tty

    old = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def read(timeout: float) -> str:
            ready, _, _ = select.select([fd], [], [], timeout)
            return os.read(fd, 1).decode(errors="replace") if ready else ""

        yield read
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, old)


def run(fetch: Callable[[], Snapshot], console: Any, interval: float, iterations: int, live: bool,
        stdin: Any = None) -> int:
    """Refresh until ``q`` (live) or for ``iterations`` frames (0: until ``q``); frames drawn."""
    prev: Snapshot | None = None
    frames = 0
    if not live:
        while True:
            cur = fetch()
            console.print(render(rates(prev, cur), live=False))
            frames += 1
            if iterations and frames >= iterations:
                return frames
            prev = cur
            time.sleep(interval)
    from rich.live import Live

    with _keys(stdin or sys.stdin) as key, Live(console=console, auto_refresh=False, screen=False,
                                                transient=False) as view:
        while True:
            cur = fetch()
            view.update(render(rates(prev, cur)), refresh=True)
            frames += 1
            if iterations and frames >= iterations:
                return frames
            prev = cur
            end = time.monotonic() + interval
            while (left := end - time.monotonic()) > 0:
                if key(left).lower() == "q":
                    return frames
