"""Recovery: make the index and the segment files agree again.

At open (``recover``): segments whose writer died are sealed and cut back to their last
indexed record; registered segments whose file vanished are forgotten with their
chunks; segment files the index does not know are removed when they are garbage for
certain. After a lost index: ``rebuild_index`` indexes the records of the segment files
again and ``restore`` brings back what the metadata journal kept. The check on demand
(``Store.check``) is ``check.py``'s, which asks this part about absent tiers and unknown
files.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import threading
from typing import Any

from ..clock import SYSTEM_CLOCK, Clock
from ..config import TIER_NAMES
from ..errors import StoreError
from ..format.private import TIER_MARKER, UnsafePath, marked_id, read_marker, write_marker
from ..format.record import ALIGN, segment_name
from ..format.segment import ForeignSegment
from ..index import (
    ORIGIN_LOCAL,
    ORIGIN_REMOTE,
    SEG_OPEN,
    SEG_SEALED,
    Entry,
    Index,
    SegmentRecord,
    Txn,
)
from ..tiers.space import Space, TierState
from ..types import Problem
from .namespaces import Namespaces
from .pins import Pins

log = logging.getLogger("lmctl.store")

class Recovery:
    """Seals, forgets, removes and rebuilds."""

    def __init__(self, index: Index, space: Space, path: str, lock: threading.RLock,
                 store_id: str | None = None, *, rebooted: bool = False, clock: Clock = SYSTEM_CLOCK) -> None:
        self.index = index
        self.clock = clock
        self.space = space
        self.tiers = space.tiers
        self.path = path
        self.lock = lock
        #: this store's id (None: a store of an earlier version, opened read-only)
        self.store_id = store_id
        #: the machine rebooted since the store was last opened for writing (its tmpfs is new)
        self.rebooted = rebooted

    # -- tier folders --------------------------------------------------------------------
    def mark_tiers(self, segs: list[tuple[int, SegmentRecord]]) -> None:
        """Put a marker file naming this store in each tier folder that is really the tier's:
        a new tier, or one where at least one registered segment file is. A folder without it
        (an unmounted disk's empty mount point, a moved folder) is never taken for lost
        segments. A folder whose marker names another store, or that holds segment files
        but no marker (this store did not make them), is refused (``UnsafePath``): nothing in
        it is indexed, cut or removed."""
        for st in self.tiers.values():
            marker = os.path.join(st.io.dir, TIER_MARKER)
            text = self.check_marker(st)
            if text is not None:
                if marked_id(text) is None and self.store_id is not None:  # an earlier version's
                    write_marker(marker, self._marker_text(st))
                continue
            mine = [sid for sid, s in segs if s.tier == st.tid]
            if mine and not any(os.path.exists(st.io.path(sid)) for sid in mine):
                continue
            if not mine and st.io.segment_ids() and self.check_marker(st) is None:  # (made meanwhile?)
                raise UnsafePath(f"{st.io.what} {st.io.dir} holds segment files but no marker of this store: "
                                 "this store did not make them; move them away or choose an empty folder")
            write_marker(marker, self._marker_text(st))

    def _marker_text(self, st: TierState) -> str:
        return f"lmctl tier {st.name} of store {self.store_id} at {self.path}\n"

    def check_marker(self, st: TierState) -> bytes | None:
        """The marker of ``st``'s folder (None: it has none); ``UnsafePath`` if it names another
        store."""
        text = read_marker(os.path.join(st.io.dir, TIER_MARKER))
        owner = marked_id(text)
        if owner is not None and self.store_id is not None and owner != self.store_id:
            raise UnsafePath(f"{st.io.what} {st.io.dir} belongs to another store ({owner}, says its "
                             f"{TIER_MARKER}); give this store's {st.name} tier a folder of its own")
        return text

    def absent_tiers(self) -> set[str]:
        """Tiers whose folder is not the tier's (no marker): an unmounted disk or a moved
        folder, not lost segments. Their entries are never dropped for that. The dram tier after
        a reboot (``rebooted``) is not absent: it lives on tmpfs, whose files a reboot removes,
        so its chunks are gone for good. (Without a reboot a missing dram folder may be another
        mount namespace's view of /dev/shm: then it is absent like any other.)"""
        absent = self.unavailable()
        for name in absent:
            log.error("%s", self.absent_message(name))
        return absent

    def unavailable(self) -> set[str]:
        """``absent_tiers`` without a word in the log (a stat per tier): for health checks."""
        return {st.name for st in self.tiers.values()
                if not (st.name == "dram" and self.rebooted)
                and not os.path.exists(os.path.join(st.io.dir, TIER_MARKER))}

    def absent_message(self, name: str) -> str:
        return (f"tier {name}: none of its segment files is in {self.tiers[name].io.dir}; is its disk mounted, "
                "or did its folder move? Its chunks are kept in the index until it is back")

    # -- vanished segments ---------------------------------------------------------------
    def segments(self) -> list[tuple[int, SegmentRecord]]:
        with self.index.read() as t:
            return t.segments()

    def forget_missing_segments(self) -> list[Problem]:
        """See ``Store.forget_missing_segments``."""
        problems: list[Problem] = []
        segs = self.segments()
        absent = self.absent_tiers()
        for name in absent:
            problems.append(Problem("tier-unavailable", self.absent_message(name)))
        for sid, s in segs:
            st = self.tiers.get(TIER_NAMES.get(s.tier, ""))
            if st is None or st.name in absent or s.state != SEG_SEALED or os.path.exists(st.io.path(sid)):
                continue
            n = self.forget_segment(st, sid)
            if n is not None:
                problems.append(Problem("missing-segment", f"segment {sid} of tier {st.name} vanished; "
                                        f"its {n} chunk(s) were dropped from the index", True))
                log.warning("segment %d of tier %s vanished; dropped its %d chunk(s) from the index", sid, st.name, n)
        return problems

    def forget_segment(self, st: TierState, sid: int) -> int | None:
        """Forget a registered segment whose file is gone, and every entry in it."""

        def fn(t: Txn) -> int | None:
            if t.segment(sid) is None or os.path.exists(st.io.path(sid)):
                return None
            return _forget_vanished(t, st, sid)

        with self.lock:
            n = self.index.write(fn)
            st.io.forget(sid)
        return n

    # -- at open -------------------------------------------------------------------------
    def recover(self) -> list[Problem]:
        """See ``Store.recover``."""
        self.mark_tiers(self.segments())
        problems: list[Problem] = self.forget_missing_segments()
        absent = self.absent_tiers()
        for sid, s in self.segments():
            st = self.tiers.get(TIER_NAMES.get(s.tier) or "")
            if st is None or st.name in absent or s.state != SEG_OPEN or sid == st.open_seg:
                continue
            try:
                # the file this store made, not a link, FIFO or file swapped in after the crash
                fd = st.io.open_own(sid, os.O_RDWR, headless=True)
            except FileNotFoundError:
                fd = -1
            except ForeignSegment as exc:
                log.error("segment %d of tier %s: %s; its chunks are dropped, the file is left alone", sid,
                          st.name, exc)
                problems.append(Problem("foreign-file", f"{exc}; left alone"))
                fd = -1
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue  # its writer is alive
            try:
                problem = self.index.write(functools.partial(self._seal_dead, st=st, sid=sid, fd=fd))
                if problem is not None:
                    problems.append(problem)
            finally:
                if fd >= 0:
                    os.close(fd)
        problems.extend(self.remove_orphan_files())
        return problems

    @staticmethod
    def _seal_dead(t: Txn, st: TierState, sid: int, fd: int) -> Problem | None:
        """Seal a segment whose writer died (``fd``: its file, locked; -1: the file is gone)."""
        cur = t.segment(sid)
        if cur is None or cur.state != SEG_OPEN:
            return None
        if fd < 0:
            # the file is gone: forget it and everything indexed in it
            _forget_vanished(t, st, sid)
            return Problem("missing-segment", f"segment {sid} vanished")
        # bytes past the last indexed record were never made visible: cut them
        end = ALIGN
        for _key, e in t.entries_in_segment(sid):
            end = max(end, e.off + e.rec_len)
        os.ftruncate(fd, end)
        t.add(f"used:{st.name}", end - cur.size)
        cur.size = end
        cur.state = SEG_SEALED
        if cur.live_count == 0:
            t.drop_segment(st.name, sid, cur)
        else:
            t.put_segment(sid, cur)
        return Problem("orphan-segment", f"sealed segment {sid} of a dead writer", True)

    def remove_orphan_files(self) -> list[Problem]:
        """Delete segment files the index does not know, whose writer is dead, and that
        are garbage for certain:

        * a file that holds no record: a writer killed between creating a segment and
          registering it (records are appended only after registration);
        * a file the index itself forgot: its id was issued by this index, it is no longer
          registered and no index entry points into it. That is a segment whose last chunk
          was evicted or compacted away, by a process killed after that commit and before it
          could unlink the file.

        Any other file that holds records (one this index never issued, as after the index
        was lost) is never deleted here: it is reported, and ``rebuild_index`` can take it back.
        A file that is not this store's segment (a link, a FIFO, another user's file, another
        store's segment) is reported and never opened for more than a check, nor removed."""
        problems: list[Problem] = []
        for st, sid in self.unknown_files():
            p = Problem("orphan-file", f"{segment_name(sid)} in tier {st.name} is not in the index")
            try:
                fd = st.io.open_own(sid, headless=True)
            except FileNotFoundError:
                continue
            except ForeignSegment as exc:  # never this store's to remove
                problems.append(Problem("foreign-file", f"{exc}; left alone"))
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with self.index.read() as t:  # registered meanwhile by its (now finished) writer?
                    if t.segment(sid) is not None:
                        continue
                    forgotten = sid <= t.counter("next_segment") and not t.entries_in_segment(sid)
                if os.fstat(fd).st_size > ALIGN and not forgotten:
                    p.detail += " and holds records; run rebuild to index them"
                    problems.append(p)
                    continue
                os.unlink(st.io.path(sid))
                p.fixed = True
            except BlockingIOError:
                p.detail += " (a live writer holds it; left alone)"
            finally:
                os.close(fd)
            problems.append(p)
        return problems

    @staticmethod
    def unknown_problem(st: TierState, sid: int) -> Problem:
        """What a file the index does not know is: an orphan of this store's, or not a segment
        of this store at all (opened only to tell)."""
        try:
            os.close(st.io.open_own(sid, headless=True))
        except ForeignSegment as exc:
            return Problem("foreign-file", f"{exc}; left alone")
        except FileNotFoundError:
            pass
        return Problem("orphan-file", f"{segment_name(sid)} in tier {st.name} is not in the index")

    def unknown_files(self) -> list[tuple[TierState, int]]:
        """Segment files on disk that the index does not know (this process's open one aside)."""
        with self.index.read() as t:
            known = {sid for sid, _s in t.segments()}
        return [(st, sid) for st in self.tiers.values() for sid in st.io.segment_ids()
                if sid not in known and sid != st.open_seg]

    # -- after a lost index ----------------------------------------------------------------
    def rebuild_index(self) -> int:
        """See ``Store.rebuild_index``."""
        found = 0
        for st in self.tiers.values():
            for sid in st.io.segment_ids():
                if sid == st.open_seg:
                    continue
                try:  # only this store's own segments (a planted file is never indexed)
                    fd = st.io.open_own(sid)
                except (FileNotFoundError, ForeignSegment) as exc:
                    log.warning("rebuild: %s in tier %s is not taken: %s", segment_name(sid), st.name, exc)
                    continue
                try:
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                try:
                    recs = [(off, tr) for off, tr in st.io.scan(sid, size)
                            if tr is not None and st.io.verify_payload(sid, off, tr)]
                except (FileNotFoundError, ForeignSegment) as exc:  # swapped meanwhile
                    log.warning("rebuild: %s in tier %s is not taken: %s", segment_name(sid), st.name, exc)
                    continue

                def fn(t: Txn, st: TierState = st, sid: int = sid, size: int = size,
                       recs: list[Any] = recs) -> int:
                    n = 0
                    if t.segment(sid) is None:
                        t.put_segment(sid, SegmentRecord(st.tid, SEG_SEALED, 0, size, 0, 0, self.clock.time()))
                        t.add(f"used:{st.name}", size)
                    if t.counter("next_segment") < sid:
                        t.set_counter("next_segment", sid)
                    for off, tr in recs:
                        if t.entry_raw(tr.key) is not None:
                            continue
                        e = Entry(sid, off, tr.record_len, tr.stored_len, tr.raw_len, tr.checksum,
                                  int(tr.meta.get("tokens", 0)), 0, tr.codec, st.tid, tr.created,
                                  tr.created, tr.meta.get("layout", {}), 0, *_origin_of(tr.meta))
                        t.index_entry(tr.key, e, _prefix_of(tr.meta))
                        n += 1
                    return n

                with self.lock:
                    found += self.index.write(fn)
        return found

    def restore(self, state: dict[str, Any] | None, namespaces: Namespaces, pins: Pins) -> None:
        """After the index was lost: chunks from the segments, then what the journal kept
        (``state``: the journal replayed; None when there is no journal)."""
        dropped = state["dropped"] if state is not None else set()
        if dropped:
            # segments the lost index had already dropped (their chunks evicted or moved): a
            # kill before their unlink left them; they are not taken back
            for st in self.tiers.values():
                for sid in st.io.segment_ids():
                    if sid in dropped:
                        try:  # this store's own file only
                            os.close(st.io.open_own(sid, headless=True))
                        except (FileNotFoundError, ForeignSegment):
                            continue
                        os.unlink(st.io.path(sid))
        found = self.rebuild_index() if any(st.io.segment_ids() for st in self.tiers.values()) else 0
        if dropped:
            top = max(dropped)

            def issued(t: Txn) -> None:  # segment ids are never issued twice
                if t.counter("next_segment") < top:
                    t.set_counter("next_segment", top)

            self.index.write(issued)
        if state is None:
            log.warning("store %s: the index was missing; rebuilt %d chunk(s) from the segment files. No "
                        "metadata journal: pins, labels, namespace records and settings could not be restored",
                        self.path, found)
            return
        namespaces.put_records(state["namespaces"])
        pinned = failed = 0
        for label, entry in state["labels"].items():
            keys = [bytes.fromhex(k) for k in entry["keys"]]
            try:
                pinned += pins.pin(label, keys, expected_bytes=int(entry.get("expected", 0)), journal=False)
            except StoreError as exc:
                failed += 1
                log.warning("could not restore the pins of label %r: %s", label, exc)
        log.warning("store %s: the index was missing; rebuilt %d chunk(s) from the segment files and restored "
                    "from the metadata journal: the settings, %d namespace record(s), %d label(s) with %d pin(s)%s",
                    self.path, found, len(state["namespaces"]), len(state["labels"]) - failed, pinned,
                    f"; {failed} label(s) could not be pinned again" if failed else "")


def _origin_of(meta: Any) -> tuple[int, int]:
    """``Entry.origin`` and ``Entry.writer`` from what a record's trailer says of its origin."""
    o = meta.get("origin") if isinstance(meta, dict) else None
    if not isinstance(o, dict) or o.get("tier") != "remote":
        return ORIGIN_LOCAL, 0
    w = o.get("writer")
    return ORIGIN_REMOTE, w if isinstance(w, int) and 0 <= w < 1 << 32 else 0


def _prefix_of(meta: Any) -> bytes | None:
    """The token prefix id a record's trailer names (``PutItem.prefix``), if any."""
    text = meta.get("prefix") if isinstance(meta, dict) else None
    try:
        return bytes.fromhex(text) if isinstance(text, str) and len(text) == 32 else None
    except ValueError:
        return None


def _forget_vanished(t: Txn, st: TierState, sid: int) -> int:
    """In ``t``: unindex every entry of segment ``sid`` (its file is gone), log them as
    corrupt, and drop the segment's record; the number of entries forgotten."""
    entries = t.entries_in_segment(sid)
    for key, e in entries:
        t.unindex_entry(key, e)
    if entries:
        t.event("corrupt", "segment-missing", [k for k, _e in entries], tier=st.name,
                detail=f"segment {sid}'s file vanished")
    cur = t.segment(sid)
    if cur is not None:
        t.drop_segment(st.name, sid, cur, remove_file=False)
    return len(entries)
