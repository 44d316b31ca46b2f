"""Tier space: each tier's folder of segment files, and where new records go.

Each writing process appends only to segments it created and holds an exclusive
``flock`` on (its *open* segment per tier). Space is reserved in the index (the
segment's size grows) before any byte is written, so a tier's capacity holds across
processes. A reservation that fails is given back (``release``); a segment file made in
an index transaction that aborts is removed again (``Txn.on_abort``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from ..clock import SYSTEM_CLOCK, Clock
from ..config import StoreConfig, TierConfig
from ..errors import StoreError
from ..format.record import ALIGN
from ..format.segment import SegmentIO
from ..index import SEG_OPEN, SEG_SEALED, Index, SegmentRecord, Txn
from .admission import note_written

log = logging.getLogger("lmctl.store")

#: (segment id, offset, fd) where one record goes; None where it was not given space
Slot = tuple[int, int, int]


@dataclass
class TierState:
    """One configured tier in this process: its settings, its segment I/O and the segment
    this process appends to."""

    name: str
    tid: int
    cfg: TierConfig
    io: SegmentIO
    open_seg: int | None = None
    open_fd: int | None = None
    retired_fds: list[int] = field(default_factory=list)


class Space:
    """Segment allocation and removal for the tiers of one store."""

    def __init__(self, index: Index, tiers: dict[str, TierState], config: Callable[[], StoreConfig],
                 journal_add: Callable[..., None], lock: threading.RLock, clock: Clock = SYSTEM_CLOCK) -> None:
        self.index = index
        self.clock = clock  # when a segment was made
        self.tiers = tiers
        self._config = config
        self._journal_add = journal_add
        self.lock = lock

    def tier(self, name: str) -> TierState:
        """The tier called ``name``; ``StoreError`` naming the configured ones if there is none."""
        try:
            return self.tiers[name]
        except KeyError:
            raise StoreError(
                f"tier {name!r} is not configured in this store (configured: {', '.join(self.tiers)})"
            ) from None

    def used(self, tier: str) -> int:
        with self.index.read() as t:
            return t.counter(f"used:{tier}")

    def segment_bytes(self, st: TierState) -> int:
        # small tiers get small segments, so that dead space is never a large share
        return max(4 * ALIGN, min(self._config().segment_bytes, st.cfg.capacity // 16))

    # -- reserving ---------------------------------------------------------------------
    def reserve(self, st: TierState, needs: list[tuple[bytes, int]],
                replacing: set[bytes] | None = None, also: Callable[[Txn], None] | None = None) -> list[Slot | None]:
        """Reserve room for records (key, length) in this process's open segment of ``st``,
        in one transaction. A key already stored (unless being replaced) or a record that
        does not fit under the tier's capacity gets None (and the latter is counted).
        ``also``: more to do in that transaction (the admission's record of the keys saved)."""

        def fn(t: Txn) -> list[Slot | None]:
            if also is not None:
                also(t)
            out: list[Slot | None] = []
            cap = st.cfg.capacity
            used = t.counter(f"used:{st.name}")
            for key, n in needs:
                present = key not in (replacing or ()) and t.entry_raw(key) is not None
                if present:
                    out.append(None)
                    continue
                if n + ALIGN > cap or used + n > cap:
                    out.append(None)
                    t.add("rejected_full", 1)
                    continue
                out.append(self.alloc(t, st, n))
                used += n
            return out

        return self.index.write(fn)

    def alloc(self, t: Txn, st: TierState, n: int) -> Slot:
        """Grow this process's open segment of ``st`` by ``n`` bytes (opening a new
        segment when it is full): where the record goes."""
        sid = self._open_segment(t, st, n)
        s = t.must_segment(sid)
        off = s.size
        s.size += n
        t.put_segment(sid, s)
        t.add(f"used:{st.name}", n)
        note_written(t, st.name, n, self.clock.time())  # the endurance count (a write of the tier's)
        assert st.open_fd is not None
        return sid, off, st.open_fd

    def _open_segment(self, t: Txn, st: TierState, need: int) -> int:
        if st.open_seg is not None:
            s = t.segment(st.open_seg)
            if s is not None:
                if s.size + need <= self.segment_bytes(st) or s.size <= ALIGN:
                    return st.open_seg
                s.state = SEG_SEALED  # an empty sealed segment is removed by compaction
                t.put_segment(st.open_seg, s)
            prev = (st.open_seg, st.open_fd)
            self.drop_open(st)
            t.on_abort(lambda: self._restore_open(st, prev))
        while True:
            sid = t.add("next_segment", 1)
            try:
                fd = st.io.create(sid)
                break
            except FileExistsError:
                continue  # left by a writer that died before registering it; recovery removes it
        t.on_abort(lambda: self._discard_new(st, sid, fd))
        t.put_segment(sid, SegmentRecord(st.tid, SEG_OPEN, os.getpid(), ALIGN, 0, 0, self.clock.time()))
        t.add(f"used:{st.name}", ALIGN)
        t.add("written_bytes", ALIGN)
        note_written(t, st.name, ALIGN, self.clock.time())
        st.open_seg, st.open_fd = sid, fd
        return sid

    @staticmethod
    def _restore_open(st: TierState, prev: tuple[int | None, int | None]) -> None:
        """Undo ``drop_open`` of an aborted transaction: the segment is still ours and open."""
        sid, fd = prev
        if fd is not None and fd in st.retired_fds:
            st.retired_fds.remove(fd)
        st.open_seg, st.open_fd = sid, fd

    @staticmethod
    def _discard_new(st: TierState, sid: int, fd: int) -> None:
        """Undo the creation of a segment whose registration was rolled back (no record
        was written to it: records are written only after the reservation commits)."""
        if st.open_seg == sid:
            st.open_seg = st.open_fd = None
        os.close(fd)
        try:
            os.unlink(st.io.path(sid))
        except FileNotFoundError:
            pass

    def release(self, st: TierState, plan: list[Slot | None]) -> None:
        """Give back the space a failed batch reserved: each segment it wrote to is cut back to
        where the batch began in it (this process appends alone to its segments, under the
        store's lock, so that region is the tail)."""
        start: dict[int, tuple[int, int]] = {}
        for slot in plan:
            if slot is not None:
                seg, off, fd = slot
                if seg not in start or off < start[seg][0]:
                    start[seg] = (off, fd)

        def fn(t: Txn) -> None:
            for seg, (off, _fd) in start.items():
                s = t.segment(seg)
                if s is not None and s.size > off:
                    t.add(f"used:{st.name}", off - s.size)
                    s.size = off
                    t.put_segment(seg, s)

        try:
            self.index.write(fn)
        except StoreError as exc:  # the index's own disk is full too: recovery recounts
            log.warning("could not give back the space of a failed write: %s", exc)
        for _seg, (off, fd) in start.items():
            try:
                os.ftruncate(fd, off)
            except OSError:
                pass

    # -- sealing and removing ----------------------------------------------------------
    def drop_open(self, st: TierState) -> None:
        """Stop appending to the open segment (its fd may still be in use by a batch being
        written: it is closed later, by ``close_retired``)."""
        if st.open_fd is not None:
            st.retired_fds.append(st.open_fd)
        st.open_fd = None
        st.open_seg = None

    @staticmethod
    def close_retired(st: TierState) -> None:
        while st.retired_fds:
            os.close(st.retired_fds.pop())

    def seal_open(self, st: TierState) -> None:
        """Seal this process's open segment of a tier (so compaction may take it)."""
        sid = st.open_seg
        if sid is None:
            return

        def seal(t: Txn) -> None:
            s = t.segment(sid)
            if s is not None:
                s.state = SEG_SEALED
                t.put_segment(sid, s)

        self.index.write(seal)
        self.drop_open(st)
        self.close_retired(st)

    def remove_files(self, dropped: list[tuple[str, int]]) -> None:
        """Delete the files of segments an index transaction has just forgotten (called by
        the index after the commit)."""
        # a rebuild after a lost index must not take these back, should a kill leave one
        self._journal_add("drop_segments", ids=sorted({sid for _t, sid in dropped}))
        for tname, sid in dropped:
            st = self.tiers[tname]
            st.io.forget(sid)
            if st.open_seg == sid:
                continue
            try:
                os.unlink(st.io.path(sid))
            except FileNotFoundError:
                pass
