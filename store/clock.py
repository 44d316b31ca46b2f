"""The clock the store's parts read time from.

Every part that reads time is given a ``Clock`` when it is built (the store's, by default the
system's): wall time (``time``: access times, creation times, event times, retirement and
cold ages, gauges) and monotonic time (``monotonic``: retry and backoff deadlines, durations).
A ``ManualClock`` stands still until it is moved, so a test advances time instead of sleeping.
Timers that wake a background thread (the access log's flush, the index's late sync) wait in
real time whatever the clock says: a manual clock makes work due, it does not run it.
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """Wall time and monotonic time, in seconds."""

    def time(self) -> float:
        """Seconds since the epoch (``time.time``)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (``time.monotonic``)."""
        ...


class SystemClock:
    """The machine's clocks."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


#: the clock of a store that is given none
SYSTEM_CLOCK: Clock = SystemClock()


class ManualClock:
    """A clock that moves only when told to (``advance``); thread-safe. It starts at
    the machine's wall time (so that times it gives look like real ones) and at monotonic 0."""

    def __init__(self, start: float | None = None) -> None:
        self._lock = threading.Lock()
        self._wall = time.time() if start is None else float(start)
        self._mono = 0.0

    def time(self) -> float:
        with self._lock:
            return self._wall

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def advance(self, seconds: float) -> None:
        """Move both clocks ``seconds`` forward."""
        if not seconds >= 0:
            raise ValueError(f"a clock does not go back ({seconds!r} s)")
        with self._lock:
            self._wall += seconds
            self._mono += seconds
