"""Admission and endurance: which computed chunks are worth writing to the nvme tier, and how
much the store writes to it per day against the operator's budget.

Admission (``admit``). Most prefixes an engine computes are never read again, yet with
``admit = "all"`` each costs a write to the SSD. With ``second-hit`` a chunk saved to the
nvme tier is written only once its key has been saved before: the first save records the
key in the *ghost list* and stores nothing (the engine sees a normal result: counted in
``not_admitted_total``, not an error), the second is admitted. A chunk key is
prefix-chained, so a key seen twice means its whole prefix was computed twice. With a dram
tier in front, saves land in dram as always; when eviction takes a chunk out of dram it
moves to nvme only if it earned it there: it was read while in dram, or its key had been
saved before it arrived; otherwise it is dropped (counted with path ``spill``). Pinned
chunks (and chunks promoted from the remote tier, which were read) are always admitted;
chunks a caller puts to a named tier, moves and compaction are never asked.

The ghost list lives in the index (sub-database ``admission``, store/index/schema.py), so it
survives restarts and every process of a store shares it: a row per key fingerprint (16
bytes of BLAKE2b of the chunk key) with its ring slot and how often it was saved, and a ring
of ``admit_ghosts`` slots replaced in FIFO order (the counter ``ghost_hand`` turns it): the
oldest key is forgotten when a new one arrives. A lookup never records a key: a request
looks its prefix up before it computes it, and that must not count as the first sighting.

Endurance (``tiers.nvme.write_budget``). Every byte reserved in the nvme tier (records,
segment headers, compaction's copies, dram spills) is added, in the same transaction, to a
row per hour of the tier's writes; rows older than a day are dropped. The rate per day is the
last 24 hours' bytes over the time they cover (since counting began, when that is less,
and never less than an hour, so that a burst right after a start does not read as a day's
worth), times a day. ``lmctl status`` warns when that rate is over the budget.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from ..clock import SYSTEM_CLOCK, Clock
from ..config import TIER_IDS, StoreConfig
from ..index import ORIGIN_REMOTE, Entry, Index, Txn
from ..index.schema import (
    GHOST_SLOT,
    ghost_row,
    ghost_slot_row,
    written_hour,
    written_row,
    written_since_row,
)

#: a ghost row's value: its ring slot and how often its key was saved (at most 255)
_GHOST = struct.Struct(">IB")
_U64 = struct.Struct("<Q")
_F64 = struct.Struct("<d")
HOUR_S = 3600
DAY_S = 86400
#: the shortest time a rate per day is projected from
MIN_WINDOW_S = 3600.0
#: the tier whose writes are counted and gated
NVME = "nvme"


def fingerprint(key: bytes) -> bytes:
    """What the ghost list keeps of a chunk key: 16 bytes of its BLAKE2b digest."""
    return hashlib.blake2b(key, digest_size=16).digest()


@dataclass
class WriteRate:
    """Bytes written to a tier: all time, in the last day, the rate per day projected from
    them, and the budget it is held against (``lmctl status``, the metrics)."""

    tier: str
    written_bytes: int
    written_24h_bytes: int
    per_day_bytes: float
    window_s: float
    budget: str | None = None
    budget_bytes_per_day: int | None = None

    @property
    def over_budget(self) -> bool:
        """Whether the store is on course to write more per day than its budget."""
        return self.budget_bytes_per_day is not None and self.per_day_bytes > self.budget_bytes_per_day

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "per_day_bytes": round(self.per_day_bytes), "window_s": round(self.window_s, 1),
                "over_budget": self.over_budget}


def note_written(t: Txn, tier: str, nbytes: int, now: float) -> None:
    """Count ``nbytes`` written to ``tier`` at time ``now`` (in the transaction that reserves
    them). Only the nvme tier is counted."""
    if tier != NVME or nbytes <= 0 or not t.index.has_admission:
        return
    tid = TIER_IDS[tier]
    hour = int(now // HOUR_S)
    row = written_row(tid, hour)
    raw = t.get("admission", row)
    if raw is None:  # a new hour: forget the hours more than a day old
        old = [k for k, _v in t.rows("admission", written_row(tid)) if written_hour(k) <= hour - 24]
        for k in old:
            t.delete("admission", k)
        if t.get("admission", written_since_row(tid)) is None:
            t.put("admission", written_since_row(tid), _F64.pack(now))
    prev = _U64.unpack(raw)[0] if raw is not None and len(raw) == _U64.size else 0
    t.put("admission", row, _U64.pack(prev + nbytes))
    t.add(f"tier_written:{tier}", nbytes)


def write_rate(t: Txn, tier: str, now: float, budget: str | None = None,
               budget_bytes: int | None = None) -> WriteRate:
    """What ``tier`` wrote, as of ``now`` (see the module's docstring for the rate)."""
    total = t.counter(f"tier_written:{tier}")
    if not t.index.has_admission:
        return WriteRate(tier, total, 0, 0.0, 0.0, budget, budget_bytes)
    tid = TIER_IDS[tier]
    hour = int(now // HOUR_S)
    first = hour - 23
    last_day = 0
    for k, v in t.rows("admission", written_row(tid)):
        if first <= written_hour(k) <= hour and len(v) == _U64.size:
            last_day += _U64.unpack(v)[0]
    raw = t.get("admission", written_since_row(tid))
    since = _F64.unpack(raw)[0] if raw is not None and len(raw) == _F64.size else now
    if not since == since:  # NaN from a damaged row
        since = now
    start = max(since, first * HOUR_S)
    window = max(now - start, MIN_WINDOW_S)
    return WriteRate(tier, total, last_day, last_day / window * DAY_S, min(max(now - start, 0.0), DAY_S),
                     budget, budget_bytes)


class Admission:
    """The ghost list and the admission decisions of one store (see the module's docstring)."""

    def __init__(self, index: Index, config: Callable[[], StoreConfig], clock: Clock = SYSTEM_CLOCK) -> None:
        self.index = index
        self._config = config
        self.clock = clock

    def second_hit(self) -> bool:
        """Whether chunks must earn their place in the nvme tier (``admit = "second-hit"``)."""
        return self._config().admit == "second-hit" and self.index.has_admission

    def gates(self, tier: str) -> bool:
        """Whether an engine's save to ``tier`` is asked for admission."""
        return tier == NVME and self.second_hit()

    def decide(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of ``keys``, saved to the nvme tier now, are written: those seen before (in the
        ghost list), pinned, or stored already (the write path then skips them as it would).
        Reads only: ``note`` records the sighting in the reserving transaction."""
        with self.index.read() as t:
            return [t.entry_raw(k) is not None or t.pinned(k) or self._seen(t, k) >= 1 for k in keys]

    def spill_admits(self, victims: Sequence[tuple[bytes, Entry]], read_lately: Callable[[bytes], bool]) -> list[bool]:
        """Which chunks leaving the dram tier move to nvme: pinned ones, ones read while in
        dram (``Entry.hits``, or ``read_lately``: reads not flushed to the index yet), ones
        promoted from the remote tier, and ones whose key was saved more than once."""
        with self.index.read() as t:
            return [e.hits > 0 or e.origin == ORIGIN_REMOTE or read_lately(k) or t.pinned(k) or self._seen(t, k) >= 2
                    for k, e in victims]

    @staticmethod
    def _seen(t: Txn, key: bytes) -> int:
        raw = t.get("admission", ghost_row(fingerprint(key)))
        return _GHOST.unpack(raw)[1] if raw is not None and len(raw) == _GHOST.size else 0

    def note(self, t: Txn, keys: Sequence[bytes]) -> None:
        """Record that ``keys`` were saved (in a write transaction): a key seen before counts
        once more; a new key takes the ring's next slot, forgetting the key that held it."""
        if not keys or not self.index.has_admission:
            return
        cap = self._config().admit_ghosts
        for key in keys:
            fp = fingerprint(key)
            row = ghost_row(fp)
            raw = t.get("admission", row)
            if raw is not None and len(raw) == _GHOST.size:
                slot, n = _GHOST.unpack(raw)
                if n < 255:
                    t.put("admission", row, _GHOST.pack(slot, n + 1))
                continue
            slot = (t.add("ghost_hand", 1) - 1) % cap
            srow = ghost_slot_row(slot)
            old = t.get("admission", srow)
            if old is not None:
                t.delete("admission", ghost_row(old))
            else:
                t.add("ghosts", 1)
            t.put("admission", srow, fp)
            t.put("admission", row, _GHOST.pack(slot, 1))

    def trim(self, t: Txn, cap: int) -> int:
        """Forget the keys in slots a ring of ``cap`` slots no longer has (``admit_ghosts``
        lowered); returns how many."""
        if not self.index.has_admission:
            return 0
        gone = [(k, v) for k, v in t.rows("admission", GHOST_SLOT, start=ghost_slot_row(cap))]
        for k, fp in gone:
            t.delete("admission", k)
            t.delete("admission", ghost_row(fp))
        if gone:
            t.add("ghosts", -len(gone))
        return len(gone)

    def ghosts(self) -> int:
        """How many keys the ghost list remembers."""
        with self.index.read() as t:
            return t.counter("ghosts")

    def slot_of(self, key: bytes) -> int | None:
        """The ring slot that remembers ``key`` (None: forgotten or never seen); for tests."""
        with self.index.read() as t:
            raw = t.get("admission", ghost_row(fingerprint(key)))
            if raw is None or len(raw) != _GHOST.size:
                return None
            slot = _GHOST.unpack(raw)[0]
            return slot if t.get("admission", ghost_slot_row(slot)) == fingerprint(key) else None
