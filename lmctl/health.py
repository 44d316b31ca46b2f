"""What the daemon knows about its own health: the maintenance thread's record of passes and
failures, the last failed jobs, and the reasons ``lmctl status --check`` fails.

The daemon keeps the records and puts them in its ``status`` reply (``daemon.maintenance``,
``failed_jobs``, ``health``); ``reasons`` decides health from that reply and a few facts only
the daemon has (which tiers are unavailable, which stayed above the high watermark after the
last maintenance pass), so every rule lives here, in one place, and can be tested alone.
Kept free of heavy imports: no store library, no rich.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

#: maintenance trims a tier that holds more than this share of its capacity
HIGH_WATERMARK = 0.95
#: a pin budget this full is reported: the next pins will be refused
PIN_BUDGET_NEARLY_FULL = 0.9
#: a maintenance pass still running after this long (or 10 intervals, if longer) is stalled
STALLED_AFTER_S = 600.0
#: failed jobs kept for ``status``
FAILED_JOBS_KEPT = 10
#: an error line is cut to this many characters
ERROR_LINE_MAX = 300


def error_line(exc: BaseException) -> str:
    """An exception as one line: its type and message (``IndexError: list index out of
    range``), never a traceback or a repr; control characters and runs of spaces folded."""
    text = " ".join(str(exc).split())
    line = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    line = "".join(c if c.isprintable() else " " for c in line)
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 1] + "…"


def one_line(text: str) -> str:
    """A message as one printable line, cut to ``ERROR_LINE_MAX`` characters."""
    line = "".join(c if c.isprintable() else " " for c in " ".join(str(text).split()))
    return line if len(line) <= ERROR_LINE_MAX else line[: ERROR_LINE_MAX - 1] + "…"


def utc(t: float) -> str:
    """A time for people and logs: ``2026-12-04 20:45:01 UTC``."""
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t))


def describe_pass(did: dict[str, int]) -> str:
    """What a maintenance pass did, in words (only what it did): ``evicted 3 chunks,
    compacted 1 segment (12.0 MiB reclaimed)``; ``nothing to do`` when it did nothing."""
    from .terminal import human

    parts = []
    if did.get("evicted"):
        parts.append(f"evicted {did['evicted']} chunk(s)")
    if did.get("segments_compacted"):
        parts.append(f"compacted {did['segments_compacted']} segment(s) ({human(did.get('bytes_reclaimed', 0))} "
                     "reclaimed)")
    if did.get("segments_forgotten"):
        parts.append(f"forgot {did['segments_forgotten']} vanished segment(s)")
    if did.get("chunks_compressed"):
        parts.append(f"compressed {did['chunks_compressed']} cold chunk(s)")
    return ", ".join(parts) or "nothing to do"


@dataclass
class Maintenance:
    """The maintenance thread's record: when it last worked and what it did, and while it
    fails, since when, how often and with what error."""

    interval_s: float
    last_ok_at: float | None = None
    last_ok: dict[str, int] | None = None  # what the last successful pass did
    failing_since: float | None = None  # the first failure of the current run of them
    consecutive_failures: int = 0
    failures_total: int = 0
    last_error: str | None = None  # kept after a recovery, with its time
    last_error_at: float | None = None
    running_since: float | None = None  # the pass running now, if one is
    #: tiers above the high watermark when the last pass ended: name -> share of capacity used
    above_watermark: dict[str, float] = field(default_factory=dict)

    def succeeded(self, did: dict[str, int], at: float) -> None:
        self.last_ok_at, self.last_ok = at, did
        self.failing_since, self.consecutive_failures = None, 0

    def failed(self, error: str, at: float) -> None:
        if self.consecutive_failures == 0:
            self.failing_since = at
        self.consecutive_failures += 1
        self.failures_total += 1
        self.last_error, self.last_error_at = error, at

    def to_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "state": self.state, "last_ok_at": self.last_ok_at,
                "last_ok": self.last_ok, "failing_since": self.failing_since,
                "consecutive_failures": self.consecutive_failures, "failures_total": self.failures_total,
                "last_error": self.last_error, "last_error_at": self.last_error_at,
                "running_since": self.running_since}

    @property
    def state(self) -> str:
        """``failing`` (the last pass failed), ``ok`` or ``pending`` (no pass yet)."""
        if self.consecutive_failures:
            return "failing"
        return "ok" if self.last_ok_at is not None else "pending"


class FailedJobs:
    """The last ``FAILED_JOBS_KEPT`` requests that failed (not usage errors, refusals or
    cancellations): what, when, and the error line its client got."""

    def __init__(self, keep: int = FAILED_JOBS_KEPT) -> None:
        self._jobs: deque[dict[str, Any]] = deque(maxlen=keep)

    def add(self, job_id: int, cmd: str, at: float, error: str) -> None:
        self._jobs.append({"id": job_id, "cmd": cmd, "at": at, "error": one_line(error)})

    def to_list(self) -> list[dict[str, Any]]:
        """Newest first."""
        return list(reversed(self._jobs))


def reason(code: str, message: str) -> dict[str, str]:
    return {"code": code, "message": one_line(message)}


def stalled_after(interval_s: float) -> float:
    """How long a maintenance pass may run before it counts as stalled."""
    return max(STALLED_AFTER_S, 10 * interval_s)


def reasons(status: dict[str, Any], unavailable: dict[str, str], above_watermark: dict[str, float],
            default_tier: str | None = None, now: float | None = None) -> list[dict[str, str]]:
    """Why the daemon needs an operator, one reason each (empty: healthy), from its
    ``status`` reply and what only it knows: ``unavailable`` tiers (name -> why) and the
    tiers ``above_watermark`` when the last maintenance pass ended (name -> share used).

    A tier counts as above its high watermark only when it still is now *and* was after the
    last pass: between passes engines may fill a tier past it, and the next pass trims it;
    one that a pass could not trim (pinned chunks, dead space it cannot reclaim) stays."""
    from .terminal import human

    out = []
    m = status["daemon"]["maintenance"]
    if m.get("consecutive_failures"):
        out.append(reason("maintenance-failing",
                          f"maintenance failing since {utc(m['failing_since'])} ({m['consecutive_failures']} "
                          f"pass(es) in a row, {m['failures_total']} in all): {m['last_error']}"))
    running = m.get("running_since")
    now = time.time() if now is None else now
    if running is not None and now - running > stalled_after(m.get("interval_s") or 0):
        out.append(reason("maintenance-stalled",
                          f"a maintenance pass has been running since {utc(running)} ({(now - running) / 60:.0f} "
                          "min): a disk under the store or a tier may be stalled (frozen, hung); nothing is evicted "
                          "or compacted meanwhile"))
    for _name, why in sorted(unavailable.items()):
        out.append(reason("tier-unavailable", why))
    store = status["store"]
    if store.get("remote_refused"):
        out.append(reason("tier-unavailable", f"tier remote not started: {store['remote_refused']}"))
    counters = store.get("counters", {})
    for name, t in store["tiers"].items():
        cap = t["capacity"]
        used = t.get("disk_bytes", t["bytes"])
        if name in above_watermark and cap and used > HIGH_WATERMARK * cap:
            out.append(reason("tier-above-watermark",
                              f"tier {name} is {100 * used / cap:.1f}% full ({human(used)} of {human(cap)}: "
                              f"{human(t.get('pinned_bytes', 0))} pinned, {human(t.get('dead_bytes', 0))} dead), "
                              f"above its high watermark of {100 * HIGH_WATERMARK:.0f}% after maintenance; unpin, "
                              "raise its capacity or see why maintenance cannot trim it"))
        budget = t.get("pin_budget", 0)
        pinned = t.get("pinned_bytes", 0) + (counters.get("pin_reserved", 0) if name == default_tier else 0)
        if budget and pinned >= PIN_BUDGET_NEARLY_FULL * budget:
            out.append(reason("pin-budget-nearly-full",
                              f"tier {name}'s pin budget is {100 * pinned / budget:.0f}% used ({human(pinned)} of "
                              f"{human(budget)}); pins beyond it are refused: unpin or raise tiers.{name}.pin_budget"))
    remote = store.get("remote")
    if remote and remote.get("breaker") == "open":
        out.append(reason("remote-breaker-open",
                          f"the remote tier's circuit breaker is open ({remote.get('url')}): its calls fail "
                          f"({remote.get('errors', 0)} errors, {remote.get('timeouts', 0)} timeouts); reads from "
                          "it are misses until the server answers again"))
    return out
