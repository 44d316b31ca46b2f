"""Counters and histograms that every process using a store adds to, kept in the index.

An engine's connector and the daemon open the same store; an exporter in the daemon must
show what all of them did. So each process counts into a ``Meter`` in memory (a dict update
under a lock: nothing on the engine's hot path touches LMDB for it), and the store adds the
pending deltas to cells in the index's ``meta`` sub-database in the write transaction of its
access log (``Reads.flush``: at most once per ``access_flush_s``, and at close). ``read_cells``
returns the totals. A process killed before its flush loses at most that interval's counts.

Cells: key ``m:`` + JSON ``[name, [[label, value], ...]]`` (labels sorted), value packed
little-endian doubles: a counter is one double; a histogram is its count, its sum, then the
count of each bucket of ``SECONDS_BUCKETS`` (not cumulative; observations above the last
bucket are only in the count).

Gauges are a process's current value (an engine's save queue depth, its loads in flight),
labelled by the process: key ``g:`` + the same JSON, value its value and the time it was set
(two doubles). Readers take the ones set recently (``max_age_s``): a process that stopped
leaves a value that ages out.
"""

from __future__ import annotations

import json
import struct
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..clock import SYSTEM_CLOCK, Clock
from .schema import METRIC_CELL, METRIC_GAUGE

#: upper bounds (seconds) of the latency histograms' buckets
SECONDS_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                                      2.5, 5.0, 10.0)
#: where the cells live in the index's meta sub-database (store/index/schema.py); gauges (a process's
#: current value, e.g. an engine's save queue) are kept apart
PREFIX, GAUGE_PREFIX = METRIC_CELL, METRIC_GAUGE
#: a gauge whose value did not change is written again after this long, so readers that take
#: values younger than a minute still see it
GAUGE_REFRESH_S = 20.0

Labels = tuple[tuple[str, str], ...]


def cell_key(name: str, labels: Labels, prefix: bytes = PREFIX) -> bytes:
    return prefix + json.dumps([name, [list(kv) for kv in labels]], separators=(",", ":")).encode()


def _labels(labels: dict[str, str]) -> Labels:
    return tuple(sorted((k, str(v)) for k, v in labels.items()))


@dataclass(frozen=True)
class Cell:
    """One stored total: a counter (``value``) or a histogram (``count``, ``sum`` and the
    count in each bucket of ``SECONDS_BUCKETS``, not cumulative)."""

    name: str
    labels: dict[str, str]
    value: float = 0.0
    count: float = 0.0
    sum: float = 0.0
    buckets: tuple[float, ...] = ()

    @property
    def histogram(self) -> bool:
        return bool(self.buckets)


@dataclass(frozen=True)
class Gauge:
    """A process's current value of ``name`` and when it was set (Unix time)."""

    name: str
    labels: dict[str, str]
    value: float
    time: float


class Meter:
    """Pending deltas (and gauge values) of this process, until the store writes them to its
    index."""

    def __init__(self, clock: Clock = SYSTEM_CLOCK) -> None:
        self._clock = clock  # when a gauge is set
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, Labels], float] = {}
        self._hists: dict[tuple[str, Labels], list[float]] = {}
        self._gauges: dict[tuple[str, Labels], tuple[float, float]] = {}
        self._gauge_last: dict[tuple[str, Labels], tuple[float, float]] = {}

    def gauge(self, name: str, value: float, **labels: str) -> bool:
        """Set the gauge ``name`` (with these labels) to ``value`` now. The same value set
        less than ``GAUGE_REFRESH_S`` ago is not written again (an idle process does not
        write every second); returns whether it will be written."""
        k = (name, _labels(labels))
        now = self._clock.time()
        with self._lock:
            last = self._gauge_last.get(k)
            if last is not None and last[0] == value and now - last[1] < GAUGE_REFRESH_S:
                return False
            self._gauge_last[k] = self._gauges[k] = (float(value), now)
        return True

    def take_gauges(self) -> dict[tuple[str, Labels], tuple[float, float]]:
        with self._lock:
            out, self._gauges = self._gauges, {}
        return out

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add ``value`` to the counter ``name`` with these labels."""
        if value:
            k = (name, _labels(labels))
            with self._lock:
                self._counts[k] = self._counts.get(k, 0.0) + value

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """One observation of the histogram ``name`` (seconds)."""
        k = (name, _labels(labels))
        with self._lock:
            h = self._hists.get(k)
            if h is None:
                h = self._hists[k] = [0.0] * (2 + len(SECONDS_BUCKETS))
            h[0] += 1
            h[1] += seconds
            for i, bound in enumerate(SECONDS_BUCKETS):
                if seconds <= bound:
                    h[2 + i] += 1
                    break

    def pending(self) -> bool:
        """Whether anything waits to be written."""
        with self._lock:
            return bool(self._counts or self._hists or self._gauges)

    def peek(self) -> tuple[dict[tuple[str, Labels], float], dict[tuple[str, Labels], list[float]],
                            dict[tuple[str, Labels], tuple[float, float]]]:
        """Copies of the pending deltas and gauge values (they stay pending)."""
        with self._lock:
            return dict(self._counts), {k: list(h) for k, h in self._hists.items()}, dict(self._gauges)

    def take(self) -> tuple[dict[tuple[str, Labels], float], dict[tuple[str, Labels], list[float]]]:
        """The pending deltas, which are forgotten here (the caller writes them)."""
        with self._lock:
            counts, self._counts = self._counts, {}
            hists, self._hists = self._hists, {}
        return counts, hists

    def give_back(self, counts: dict[tuple[str, Labels], float],
                  hists: dict[tuple[str, Labels], list[float]]) -> None:
        """Deltas a failed write could not store: pending again."""
        with self._lock:
            for k, v in counts.items():
                self._counts[k] = self._counts.get(k, 0.0) + v
            for k, h in hists.items():
                mine = self._hists.setdefault(k, [0.0] * len(h))
                for i, x in enumerate(h):
                    mine[i] += x


def add_to_cells(get: Callable[[bytes], bytes | memoryview | None], put: Callable[[bytes, bytes], object],
                 counts: dict[tuple[str, Labels], float], hists: dict[tuple[str, Labels], list[float]]) -> None:
    """Add deltas to the stored cells through ``get(key) -> bytes | None`` and ``put(key, value)``
    (the write transaction's accessors of the meta sub-database)."""
    for (name, labels), v in counts.items():
        key = cell_key(name, labels)
        raw = get(key)
        old = struct.unpack("<d", raw)[0] if raw is not None and len(raw) == 8 else 0.0
        put(key, struct.pack("<d", old + v))
    for (name, labels), h in hists.items():
        key = cell_key(name, labels)
        raw = get(key)
        n = len(h)
        old = list(struct.unpack(f"<{n}d", raw)) if raw is not None and len(raw) == 8 * n else [0.0] * n
        put(key, struct.pack(f"<{n}d", *(a + b for a, b in zip(old, h, strict=True))))


def put_gauges(put: Callable[[bytes, bytes], object], gauges: dict[tuple[str, Labels], tuple[float, float]]) -> None:
    """Write gauge values (the latest wins) through ``put(key, value)``."""
    for (name, labels), (value, at) in gauges.items():
        put(cell_key(name, labels, GAUGE_PREFIX), struct.pack("<dd", value, at))


def parse_gauges(items: Iterable[tuple[bytes, bytes]], max_age_s: float | None = None,
                 now: float | None = None) -> list[Gauge]:
    """Gauges from (key, value) pairs that start with ``GAUGE_PREFIX``, set within ``max_age_s``
    of ``now`` (default: the machine's time)."""
    if now is None:
        now = SYSTEM_CLOCK.time()
    out = []
    for key, raw in items:
        try:
            name, labels = json.loads(bytes(key[len(GAUGE_PREFIX):]))
            value, at = struct.unpack("<dd", raw)
        except (ValueError, TypeError, struct.error):
            continue
        if max_age_s is None or now - at <= max_age_s:
            out.append(Gauge(str(name), {str(k): str(v) for k, v in labels}, value, at))
    return out


def parse_cells(items: Iterable[tuple[bytes, bytes]]) -> list[Cell]:
    """Cells from (key, value) pairs of the meta sub-database that start with ``PREFIX``
    (anything malformed is skipped)."""
    out = []
    nb = len(SECONDS_BUCKETS)
    for key, raw in items:
        try:
            name, labels = json.loads(bytes(key[len(PREFIX):]))
            lab = {str(k): str(v) for k, v in labels}
        except (ValueError, TypeError):
            continue
        if len(raw) == 8:
            out.append(Cell(str(name), lab, value=struct.unpack("<d", raw)[0]))
        elif len(raw) == 8 * (2 + nb):
            vals = struct.unpack(f"<{2 + nb}d", raw)
            out.append(Cell(str(name), lab, count=vals[0], sum=vals[1], buckets=tuple(vals[2:])))
    return out
