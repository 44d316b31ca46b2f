"""A circuit breaker: stop calling a failing server, probe it again after a backoff.

Used by the remote tier (store/tiers/remote.py): a server that keeps failing costs no more network
round trips until a probe succeeds, and sharing resumes by itself when it is back.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from ..clock import SYSTEM_CLOCK
from ..errors import StoreError


class CircuitBreaker:
    """closed -> open after ``failures`` consecutive failures -> half-open once ``backoff_s``
    has passed (one probe call goes through) -> closed on its success, open again on its
    failure with the backoff doubled (at most ``backoff_max_s``). Success resets everything.
    Thread-safe."""

    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half-open"

    def __init__(self, failures: int = 3, backoff_s: float = 1.0, backoff_max_s: float = 30.0,
                 clock: Callable[[], float] = SYSTEM_CLOCK.monotonic) -> None:
        if failures < 1 or backoff_s <= 0 or backoff_max_s < backoff_s:
            raise StoreError("breaker: failures must be >= 1 and 0 < backoff_s <= backoff_max_s")
        self.threshold = failures
        self.backoff_initial = backoff_s
        self.backoff_max = backoff_max_s
        self._clock = clock
        self._lock = threading.Lock()
        self.state = self.CLOSED
        self.failures = 0
        self.backoff = backoff_s
        self.opened = 0  # times it opened
        self._reopen_at = 0.0
        self._probe = False

    def allow(self) -> bool:
        """May a call go to the server now? In half-open state only one caller (the probe)
        gets True until it reports ``success`` or ``failure``."""
        with self._lock:
            if self.state == self.CLOSED:
                return True
            if self.state == self.OPEN and self._clock() >= self._reopen_at:
                self.state = self.HALF_OPEN
                self._probe = False
            if self.state == self.HALF_OPEN and not self._probe:
                self._probe = True
                return True
            return False

    def success(self) -> bool:
        """Record a call that worked; True if this closed the breaker."""
        with self._lock:
            was = self.state
            self.state, self.failures, self.backoff, self._probe = self.CLOSED, 0, self.backoff_initial, False
            return was != self.CLOSED

    def failure(self) -> bool:
        """Record a failed call; True if this opened the breaker."""
        with self._lock:
            self.failures += 1
            if self.state == self.HALF_OPEN:
                self.backoff = min(self.backoff * 2, self.backoff_max)
            elif self.state == self.OPEN or self.failures < self.threshold:
                return False
            self.state, self._probe = self.OPEN, False
            self._reopen_at = self._clock() + self.backoff
            self.opened += 1
            return True

    def release(self) -> None:
        """A probe that ended without a verdict (a programming error): let another one try."""
        with self._lock:
            if self.state == self.HALF_OPEN:
                self._probe = False
