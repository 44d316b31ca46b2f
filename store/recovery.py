"""Recovery and checks: make the index and the segment files agree again.

At open (``recover``): segments whose writer died are sealed and cut back to their last
indexed record; registered segments whose file vanished are forgotten with their
chunks; segment files the index does not know are removed when they are garbage for
certain. On demand (``check``): every entry is checked against its file (``deep``: its
bytes too) and the counters are recounted; ``fix`` repairs what it finds. After a lost
index: ``rebuild_index`` indexes the records of the segment files again and
``restore`` brings back what the metadata journal kept.
"""

from __future__ import annotations

import fcntl
import functools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from .config import TIER_NAMES
from .errors import StoreError
from .index import SEG_OPEN, SEG_SEALED, Entry, Index, SegmentRecord, Txn, trailer_mismatch, unpack_pin
from .keys import short_key
from .namespaces import Namespaces
from .pins import Pins
from .segment import ALIGN, CorruptRecord, SegmentGone, segment_name
from .space import Space, TierState
from .types import Problem

log = logging.getLogger("lmctl.store")

#: the file that marks a folder as really a tier's (see ``Recovery.mark_tiers``)
TIER_MARKER = ".lmctl-tier"


class Recovery:
    """Seals, forgets, removes, checks, recounts and rebuilds."""

    def __init__(self, index: Index, space: Space, path: str, lock: threading.RLock) -> None:
        self.index = index
        self.space = space
        self.tiers = space.tiers
        self.path = path
        self.lock = lock
        #: the machine rebooted since the store was last opened for writing (its tmpfs is new)
        self.rebooted = False

    # -- tier folders --------------------------------------------------------------------
    def mark_tiers(self, segs: list[tuple[int, SegmentRecord]]) -> None:
        """Put a marker file in each tier folder that is really the tier's: a new tier, or one
        where at least one registered segment file is. A folder without it (an unmounted
        disk's empty mount point, a moved folder) is never taken for lost segments."""
        for st in self.tiers.values():
            marker = os.path.join(st.io.dir, TIER_MARKER)
            if os.path.exists(marker):
                continue
            mine = [sid for sid, s in segs if s.tier == st.tid]
            if mine and not any(os.path.exists(st.io.path(sid)) for sid in mine):
                continue
            try:
                fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    os.fchmod(fd, 0o600)
                    os.write(fd, f"lmctl tier {st.name} of the store at {self.path}\n".encode())
                finally:
                    os.close(fd)
            except FileExistsError:
                pass

    def absent_tiers(self) -> set[str]:
        """Tiers whose folder is not the tier's (no marker): an unmounted disk or a moved
        folder, not lost segments. Their entries are never dropped for that. The dram tier after
        a reboot (``rebooted``) is not absent: it lives on tmpfs, whose files a reboot removes,
        so its chunks are gone for good. (Without a reboot a missing dram folder may be another
        mount namespace's view of /dev/shm: then it is absent like any other.)"""
        absent = {st.name for st in self.tiers.values()
                  if not (st.name == "dram" and self.rebooted)
                  and not os.path.exists(os.path.join(st.io.dir, TIER_MARKER))}
        for name in absent:
            log.error("%s", self.absent_message(name))
        return absent

    def absent_message(self, name: str) -> str:
        return (f"tier {name}: none of its segment files is in {self.tiers[name].io.dir}; is its disk mounted, "
                "or did its folder move? Its chunks are kept in the index until it is back")

    # -- vanished segments ---------------------------------------------------------------
    def _segments(self) -> list[tuple[int, SegmentRecord]]:
        with self.index.read() as t:
            return t.segments()

    def forget_missing_segments(self) -> list[Problem]:
        """See ``Store.forget_missing_segments``."""
        problems: list[Problem] = []
        segs = self._segments()
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

        with self.lock:
            n = self.index.write(fn)
            st.io.forget(sid)
        return n

    # -- at open -------------------------------------------------------------------------
    def recover(self) -> list[Problem]:
        """See ``Store.recover``."""
        self.mark_tiers(self._segments())
        problems: list[Problem] = self.forget_missing_segments()
        absent = self.absent_tiers()
        for sid, s in self._segments():
            st = self.tiers.get(TIER_NAMES.get(s.tier) or "")
            if st is None or st.name in absent or s.state != SEG_OPEN or sid == st.open_seg:
                continue
            try:
                fd = os.open(st.io.path(sid), os.O_RDWR)
            except FileNotFoundError:
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
            gone = t.entries_in_segment(sid)
            for key, e in gone:
                t.unindex_entry(key, e)
            if gone:
                t.event("corrupt", "segment-missing", [k for k, _e in gone], tier=st.name,
                        detail=f"segment {sid}'s file vanished")
            cur = t.segment(sid)
            if cur is not None:
                t.drop_segment(st.name, sid, cur, remove_file=False)
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
        was lost) is never deleted here: it is reported, and ``rebuild_index`` can take it back."""
        problems: list[Problem] = []
        for st, sid in self.unknown_files():
            p = Problem("orphan-file", f"{segment_name(sid)} in tier {st.name} is not in the index")
            try:
                fd = os.open(st.io.path(sid), os.O_RDONLY)
            except FileNotFoundError:
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

    def unknown_files(self) -> list[tuple[TierState, int]]:
        """Segment files on disk that the index does not know (this process's open one aside)."""
        with self.index.read() as t:
            known = {sid for sid, _s in t.segments()}
        return [(st, sid) for st in self.tiers.values() for sid in st.io.segment_ids()
                if sid not in known and sid != st.open_seg]

    # -- check -----------------------------------------------------------------------------
    def check(self, fix: bool = False, deep: bool = False,
              progress: Callable[[int, int], None] | None = None) -> list[Problem]:
        """See ``Store.check``."""
        problems: list[Problem] = []
        with self.index.read() as t:
            raw_entries = [(bytes(k), Entry.read(v)) for k, v in t.raw.cursor(db=self.index.chunks)]
            segs = dict(t.segments())
        unreadable = [k for k, e in raw_entries if e is None]
        entries = [(k, e) for k, e in raw_entries if e is not None]
        bad: list[tuple[bytes, Entry]] = []
        absent = self.absent_tiers()
        problems.extend(Problem("tier-unavailable", self.absent_message(name)) for name in sorted(absent))

        def moved(key: bytes, e: Entry) -> bool:
            """Whether the entry changed since the snapshot (compaction or a rewrite moved the
            chunk, or it was evicted): then what looked wrong was the old place, not a problem."""
            with self.index.read() as t:
                cur = t.entry(key)
            return cur is None or (cur.seg, cur.off) != (e.seg, e.off)

        for i, (key, e) in enumerate(entries):
            if progress:
                progress(i + 1, len(entries))
            st = self.tiers.get(e.tier_name)
            if st is not None and st.name in absent:
                continue  # never drop a whole tier's chunks because its folder is not there
            if st is None or e.seg not in segs:
                if moved(key, e):
                    continue
                problems.append(Problem("dangling-entry", f"chunk {short_key(key)} points to missing "
                                        f"segment {e.seg}"))
                bad.append((key, e))
                continue
            if not os.path.exists(st.io.path(e.seg)):
                if moved(key, e) or os.path.exists(st.io.path(e.seg)):
                    continue
                problems.append(Problem("missing-file", f"segment {e.seg} file is missing"))
                bad.append((key, e))
                continue
            if deep:
                try:
                    trailer = st.io.read_record(e.seg, e.off, e.stored_len, None)
                    wrong = trailer_mismatch(key, e, trailer)
                    if wrong:
                        raise CorruptRecord(f"the index and the record trailer disagree on {wrong}")
                except (CorruptRecord, SegmentGone, ValueError, OverflowError) as exc:
                    if moved(key, e):
                        continue
                    problems.append(Problem("corrupt-chunk", f"chunk {short_key(key)}: {exc}"))
                    bad.append((key, e))
        if fix and bad:
            def drop(t: Txn) -> None:
                dropped = []
                for key, e in bad:
                    cur = t.entry(key)
                    if cur is not None and (cur.seg, cur.off) == (e.seg, e.off):
                        t.unindex_entry(key, cur)
                        t.add("corrupt", 1)
                        dropped.append(key)
                if dropped:
                    t.event("corrupt", "verify", dropped, detail="dropped by verify --fix")

            with self.lock:
                self.index.write(drop)
            for p in problems:
                if p.kind in ("dangling-entry", "missing-file", "corrupt-chunk"):
                    p.fixed = True
        for k in unreadable:
            problems.append(Problem("unreadable-entry", f"chunk {short_key(k)}: its index entry cannot be decoded",
                                    fix))
        if fix and unreadable:
            def forget(t: Txn) -> None:
                for k in unreadable:
                    raw = t.entry_raw(k)
                    if raw is not None and Entry.read(raw) is None:
                        t.raw.delete(k, db=self.index.chunks)
                        t.forget_prefix(k)
                        t.add("corrupt", 1)
                        t.event("corrupt", "bad-entry", [k], detail="dropped by verify --fix")

            with self.lock:
                self.index.write(forget)
        # files on disk that the index does not know
        if fix:
            problems.extend(self.remove_orphan_files())
        else:
            problems.extend(Problem("orphan-file", f"{segment_name(sid)} in tier {st.name} is not in the index")
                            for st, sid in self.unknown_files())
        problems.extend(self.recount(fix))
        return problems

    def recount(self, fix: bool) -> list[Problem]:
        """Count every counter and every segment's live bytes again from the entries;
        report (and with ``fix``, correct) those that drifted."""
        problems: list[Problem] = []

        def fn(t: Txn) -> None:
            want: dict[str, int] = {}
            seg_live: dict[int, list[int]] = {}
            for k, v in t.raw.cursor(db=self.index.chunks):
                e = Entry.read(v)
                if e is None:
                    continue  # reported (and with fix, dropped) by check
                tn = e.tier_name
                want[f"live:{tn}"] = want.get(f"live:{tn}", 0) + e.rec_len
                want[f"count:{tn}"] = want.get(f"count:{tn}", 0) + 1
                sl = seg_live.setdefault(e.seg, [0, 0])
                sl[0] += e.rec_len
                sl[1] += 1
                if t.pinned(bytes(k)):
                    want[f"pinned:{tn}"] = want.get(f"pinned:{tn}", 0) + e.rec_len
            reserved = 0
            for k, v in t.raw.cursor(db=self.index.pins):
                refs, r = unpack_pin(v)
                if refs and t.entry_raw(bytes(k)) is None:
                    reserved += r
            want["pin_reserved"] = reserved
            for sid, s in t.segments():
                tn = TIER_NAMES[s.tier]
                want[f"used:{tn}"] = want.get(f"used:{tn}", 0) + s.size
                live, count = seg_live.get(sid, [0, 0])
                if (s.live_bytes, s.live_count) != (live, count):
                    problems.append(Problem("segment-count", f"segment {sid} live "
                                            f"{s.live_bytes}/{s.live_count}, index says {live}/{count}", fix))
                    if fix:
                        s.live_bytes, s.live_count = live, count
                        t.put_segment(sid, s)
            for tn in self.tiers:
                for c in ("live", "count", "pinned", "used"):
                    want.setdefault(f"{c}:{tn}", 0)
            for name, want_v in want.items():
                have = t.counter(name)
                if have != want_v:
                    problems.append(Problem("counter", f"{name} is {have}, index says {want_v}", fix))
                    if fix:
                        t.set_counter(name, want_v)

        if fix:
            with self.lock:
                self.index.write(fn)
        else:
            with self.index.read() as t:
                fn(t)
        return problems

    # -- after a lost index ----------------------------------------------------------------
    def rebuild_index(self) -> int:
        """See ``Store.rebuild_index``."""
        found = 0
        for st in self.tiers.values():
            for sid in st.io.segment_ids():
                if sid == st.open_seg:
                    continue
                size = os.path.getsize(st.io.path(sid))
                recs = [(off, tr) for off, tr in st.io.scan(sid, size)
                        if tr is not None and st.io.verify_payload(sid, off, tr)]

                def fn(t: Txn, st: TierState = st, sid: int = sid, size: int = size,
                       recs: list[Any] = recs) -> int:
                    n = 0
                    if t.segment(sid) is None:
                        t.put_segment(sid, SegmentRecord(st.tid, SEG_SEALED, 0, size, 0, 0, time.time()))
                        t.add(f"used:{st.name}", size)
                    if t.counter("next_segment") < sid:
                        t.set_counter("next_segment", sid)
                    for off, tr in recs:
                        if t.entry_raw(tr.key) is not None:
                            continue
                        e = Entry(sid, off, tr.record_len, tr.stored_len, tr.raw_len, tr.checksum,
                                  int(tr.meta.get("tokens", 0)), 0, tr.codec, st.tid, tr.created,
                                  tr.created, tr.meta.get("layout", {}))
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


def _prefix_of(meta: Any) -> bytes | None:
    """The token prefix id a record's trailer names (``PutItem.prefix``), if any."""
    text = meta.get("prefix") if isinstance(meta, dict) else None
    try:
        return bytes.fromhex(text) if isinstance(text, str) and len(text) == 32 else None
    except ValueError:
        return None
