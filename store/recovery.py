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
import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from .clock import SYSTEM_CLOCK, Clock
from .codec import CODEC_NAMES
from .config import TIER_NAMES
from .errors import StoreError
from .index import (
    ENTRY_SIZE,
    FORMAT_VERSION,
    MAX_CHUNK_BYTES,
    ORIGIN_LOCAL,
    ORIGIN_REMOTE,
    SEG_OPEN,
    SEG_SEALED,
    Entry,
    Index,
    SegmentRecord,
    Txn,
    entry_dtype,
    entry_head,
    label_count_key,
    label_keys_key,
    pack_counts,
    pack_u64,
    trailer_mismatch,
    unpack_pin,
)
from .keys import KEY_BYTES, short_key
from .namespaces import Namespaces
from .pins import Pins
from .private import TIER_MARKER, UnsafePath, marked_id, read_marker, write_marker
from .schema import META_FORMAT, keylabel_key
from .segment import ALIGN, CorruptRecord, ForeignSegment, SegmentGone, segment_name
from .space import Space, TierState
from .types import Problem

log = logging.getLogger("lmctl.store")

#: entries per progress report of a pass over the index
PROGRESS_EVERY = 4096
#: entries decoded at once by a pass over the index
TALLY_PAGE = 8192
#: entries read per transaction by the deep check (no snapshot is held while records are read)
DEEP_PAGE = 512


class Recovery:
    """Seals, forgets, removes, checks, recounts and rebuilds."""

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
    def _unknown(st: TierState, sid: int) -> Problem:
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

    # -- check -----------------------------------------------------------------------------
    def check(self, fix: bool = False, deep: bool = False,
              progress: Callable[[int, int], None] | None = None) -> list[Problem]:
        """See ``Store.check``. One pass over the entries in one snapshot checks each against
        the segments and their files and recounts every counter (memory: the counts, not the
        entries); ``deep`` then reads every record, a page of entries per short transaction."""
        problems: list[Problem] = []
        absent = self.absent_tiers()
        problems.extend(Problem("tier-unavailable", self.absent_message(name)) for name in sorted(absent))
        with self.index.read() as t:
            tally = self._tally(t, progress, absent)
            counted = None if fix else self._keylabels(t, False) + self._compare(t, tally, False)
        suspects: list[tuple[bytes, str]] = tally["suspects"]
        unreadable: list[bytes] = tally["unreadable"]
        bad = self._confirm(suspects, problems)
        if deep:
            bad.extend(self._deep(absent, {k for k, _e in bad}, problems, progress))
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
                if p.kind in ("dangling-entry", "missing-file", "corrupt-chunk", "read-error"):
                    p.fixed = True
        for k in unreadable:
            problems.append(Problem("unreadable-entry", f"chunk {short_key(k)}: its index entry cannot be decoded",
                                    fix, key=k))
        if fix and unreadable:
            def forget(t: Txn) -> None:
                for k in unreadable:
                    raw = t.entry_raw(k)
                    if raw is not None and entry_head(raw) is None:
                        t.delete("chunks", k)
                        t.forget_prefix(k)
                        t.add("corrupt", 1)
                        t.event("corrupt", "bad-entry", [k], detail="dropped by verify --fix")

            with self.lock:
                self.index.write(forget)
        # files on disk that the index does not know
        if fix:
            problems.extend(self.remove_orphan_files())
        else:
            problems.extend(self._unknown(st, sid) for st, sid in self.unknown_files())
        problems.extend(self.recount(True) if fix else counted or [])
        return problems

    def _moved(self, key: bytes, e: Entry | None) -> bool:
        """Whether the entry changed since the snapshot (compaction or a rewrite moved the
        chunk, or it was evicted): then what looked wrong was the old place, not a problem."""
        with self.index.read() as t:
            cur = t.entry(key)
        return cur is None or e is None or (cur.seg, cur.off) != (e.seg, e.off)

    def _confirm(self, suspects: list[tuple[bytes, str]], problems: list[Problem]) -> list[tuple[bytes, Entry]]:
        """The suspects of the snapshot pass that are still wrong now (each looked up again)."""
        bad: list[tuple[bytes, Entry]] = []
        for key, kind in suspects:
            with self.index.read() as t:
                e = t.entry(key)
                seg = None if e is None else t.segment(e.seg)
            if e is None:
                continue  # evicted meanwhile
            st = self.tiers.get(e.tier_name)
            if kind == "dangling-entry" and st is not None and seg is not None:
                continue  # moved into a registered segment meanwhile
            if kind == "missing-file" and st is not None and os.path.exists(st.io.path(e.seg)):
                continue
            if kind == "dangling-entry":
                problems.append(Problem(kind, f"chunk {short_key(key)} points to missing segment {e.seg}", key=key))
            else:
                problems.append(Problem(kind, f"segment {e.seg} file is missing", key=key))
            bad.append((key, e))
        return bad

    def _deep(self, absent: set[str], skip: set[bytes], problems: list[Problem],
              progress: Callable[[int, int], None] | None) -> list[tuple[bytes, Entry]]:
        """Read and verify every record, a page of entries per read transaction."""
        bad: list[tuple[bytes, Entry]] = []
        with self.index.read() as t:
            total = sum(t.counter(f"count:{name}") for name in self.tiers)
        done = 0
        after = b""
        while True:
            page: list[tuple[bytes, Entry]] = []
            with self.index.read() as t:
                for k, v in t.rows("chunks", start=after):
                    if k == after:
                        continue
                    if len(page) >= DEEP_PAGE:
                        break
                    e = Entry.read(v)
                    after = k
                    if e is not None:
                        page.append((after, e))
            if not page:
                return bad
            for key, e in page:
                done += 1
                if progress is not None and done % PROGRESS_EVERY == 0:
                    progress(min(done, total), total)
                st = self.tiers.get(e.tier_name)
                if st is None or st.name in absent or key in skip:
                    continue
                try:
                    trailer = st.io.read_record(e.seg, e.off, e.stored_len, None)
                    wrong = trailer_mismatch(key, e, trailer)
                    if wrong:
                        raise CorruptRecord(f"the index and the record trailer disagree on {wrong}")
                except (CorruptRecord, SegmentGone, ValueError, OverflowError) as exc:
                    if self._moved(key, e):
                        continue
                    problems.append(Problem("corrupt-chunk", f"chunk {short_key(key)}: {exc}", key=key))
                    bad.append((key, e))
                except OSError as exc:  # a disk error: this chunk is unreadable; the pass goes on
                    if self._moved(key, e):
                        continue
                    problems.append(Problem("read-error", f"chunk {short_key(key)}: reading segment {e.seg} of "
                                            f"tier {st.name} at {e.off} failed: {exc}"))
                    bad.append((key, e))
            if progress is not None:
                progress(min(done, total), total)

    def _tally(self, t: Txn, progress: Callable[[int, int], None] | None = None,
               absent: set[str] | None = None) -> dict[str, Any]:
        """Count everything the index keeps counted, from the entries of snapshot ``t``: the
        tier counters, each segment's live bytes and records, and the ``counts`` records;
        and find the entries that cannot be decoded (``unreadable``) and, with ``absent``
        given (the tiers whose folder is not there), those that point to an unregistered
        segment or a missing file (``suspects``). Entries are taken a page at a time and
        each page is decoded and summed at once (numpy): a pass over a million entries
        takes about a second, and memory holds a page and the sums."""
        import numpy as np

        ENTRY_DTYPE = entry_dtype()  # noqa: N806
        idx = self.index
        counts: dict[bytes, list[int]] = {}
        seg_live: dict[int, list[int]] = {}
        segs = dict(t.segments())
        total = sum(t.counter(f"count:{name}") for name in self.tiers)
        tier_ids = np.array(sorted(TIER_NAMES), dtype=np.uint8)
        codec_ids = np.array(sorted(CODEC_NAMES), dtype=np.uint8)
        good = np.zeros(0, dtype=np.uint64)
        check = absent is not None
        if check:
            # (segment, tier) pairs an entry may point to: registered, and its file is there
            codes = []
            for st in self.tiers.values():
                for sid in set(st.io.segment_ids()):
                    if sid in segs:
                        codes.append(sid * 256 + st.tid)
            good = np.array(sorted(codes), dtype=np.uint64)
            skip = np.array(sorted(self.tiers[n].tid for n in absent or ()), dtype=np.uint8)
        suspects: list[tuple[bytes, str]] = []
        unreadable: list[bytes] = []
        done = 0

        def page(keys: Sequence[bytes], vals: Sequence[bytes]) -> None:
            n = len(keys)
            lens = np.fromiter(map(len, vals), dtype=np.int64, count=n)
            ends = np.cumsum(lens)
            starts = ends - lens
            blob = np.frombuffer(b"".join(vals) + bytes(ENTRY_SIZE + 1), dtype=np.uint8)
            heads = blob[starts[:, None] + np.arange(ENTRY_SIZE)].view(ENTRY_DTYPE).reshape(n)
            has_layout = lens > ENTRY_SIZE
            framed = ~has_layout | ((blob[starts + ENTRY_SIZE] == 0x7B) & (blob[ends - 1] == 0x7D))
            ok = ((lens >= ENTRY_SIZE) & np.isin(heads["tier"], tier_ids) & np.isin(heads["codec"], codec_ids)
                  & (heads["created"] >= 0) & (heads["created"] < 1.8e10)
                  & (heads["last"] >= 0) & (heads["last"] < 1.8e10)
                  & (heads["rec"] < MAX_CHUNK_BYTES) & (heads["stored"] < MAX_CHUNK_BYTES)
                  & (heads["raw"] < MAX_CHUNK_BYTES) & (heads["off"] % ALIGN == 0) & (heads["rec"] % ALIGN == 0)
                  & framed)
            for i in np.flatnonzero(~ok):
                unreadable.append(keys[i])
            seg, tier, rec, stored = heads["seg"], heads["tier"], heads["rec"], heads["stored"]
            if check:
                bad = ok & ~np.isin(seg * np.uint64(256) + tier, good) & ~np.isin(tier, skip)
                for i in np.flatnonzero(bad):
                    suspects.append((keys[i], "missing-file" if int(seg[i]) in segs else "dangling-entry"))
            # pinned: the pins of this page's key range (few, as a rule)
            pinned_keys: set[bytes] = set()
            for pk, pv in t.rows("pins", start=keys[0]):
                if pk > keys[-1]:
                    break
                if unpack_pin(pv)[0] > 0:
                    pinned_keys.add(pk)
            pinned = (np.fromiter((k in pinned_keys for k in keys), dtype=bool, count=n) if pinned_keys
                      else np.zeros(n, dtype=bool)) & ok
            # segments' live bytes and records
            sids, inv = np.unique(seg[ok], return_inverse=True)
            live_b = np.bincount(inv, weights=rec[ok].astype(np.float64), minlength=len(sids))
            live_n = np.bincount(inv, minlength=len(sids))
            for j, sid in enumerate(sids.tolist()):
                sl = seg_live.setdefault(sid, [0, 0])
                sl[0] += int(live_b[j])
                sl[1] += int(live_n[j])
            # per namespace and tier (keys are sorted: a page holds few namespaces)
            if all(len(k) == KEY_BYTES for k in (keys[0], keys[-1])) and sum(map(len, keys)) == n * KEY_BYTES:
                nids = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, KEY_BYTES)[:, :16].copy().view("V16")
            else:
                nids = np.frombuffer(b"".join([k[:16].ljust(16, b"\0") for k in keys]), dtype="V16")
            nids = nids.reshape(n)
            groups, ginv = np.unique(nids[ok], return_inverse=True)
            gid = ginv.astype(np.int64) * 256 + tier[ok]
            ukeys, kinv = np.unique(gid, return_inverse=True)
            p = pinned[ok]
            cols = [np.ones(len(kinv)), stored[ok].astype(np.float64), rec[ok].astype(np.float64)]
            cols += [c * p for c in cols]
            sums = [np.bincount(kinv, weights=c, minlength=len(ukeys)) for c in cols]
            for j, code in enumerate(ukeys.tolist()):
                ck = b"n" + groups[code // 256].tobytes() + bytes([code % 256])
                acc = counts.setdefault(ck, [0] * 6)
                for m in range(6):
                    acc[m] += int(sums[m][j])
            # labels of the pinned entries
            for i in np.flatnonzero(pinned):
                k = keys[i]
                d = (1, int(stored[i]), int(rec[i])) * 2
                for label in t.labels_of(k):
                    acc = counts.setdefault(label_count_key(label, k[:16], int(tier[i])), [0] * 6)
                    for m in range(6):
                        acc[m] += d[m]

        entries = t.rows("chunks")
        while True:
            batch: list[tuple[bytes, bytes]] = list(itertools.islice(entries, TALLY_PAGE))
            if not batch:
                break
            keys, vals = zip(*batch, strict=True)
            page(keys, vals)
            done += len(batch)
            if progress is not None:
                progress(min(done, total), total)
            idx.release_pages()  # a page fault maps its neighbours too: release as the pass goes
        if progress is not None:
            progress(done, max(total, done))
        want: dict[str, int] = {}
        for tn in self.tiers:
            for what in ("live", "count", "pinned", "used"):
                want[f"{what}:{tn}"] = 0
        for ck, c in counts.items():
            if ck[:1] == b"n":
                tn = TIER_NAMES.get(ck[-1], str(ck[-1]))
                want[f"count:{tn}"] = want.get(f"count:{tn}", 0) + c[0]
                want[f"live:{tn}"] = want.get(f"live:{tn}", 0) + c[2]
                want[f"pinned:{tn}"] = want.get(f"pinned:{tn}", 0) + c[5]
        reserved = 0
        for i, (pk, v) in enumerate(t.rows("pins")):
            refs, r = unpack_pin(v)
            if refs and t.entry_raw(pk) is None:
                reserved += r
            if i % 1024 == 1023:
                idx.release_pages()  # each lookup maps a page and its neighbours
        want["pin_reserved"] = reserved
        label_keys: dict[bytes, int] = {}
        for lk in t.keys("labels"):
            label, _, _key = lk.partition(b"\0")
            label_keys[label] = label_keys.get(label, 0) + 1
        for sr in segs.values():
            tn = TIER_NAMES[sr.tier]
            want[f"used:{tn}"] = want.get(f"used:{tn}", 0) + sr.size
        idx.release_pages()
        return {"want": want, "counts": counts, "seg_live": seg_live, "segs": segs, "label_keys": label_keys,
                "suspects": suspects, "unreadable": unreadable}

    def _compare(self, t: Txn, tally: dict[str, Any], fix: bool) -> list[Problem]:
        """What in the index differs from ``tally`` (with ``fix``, in a write transaction:
        corrected)."""
        problems: list[Problem] = []
        for sid, s in tally["segs"].items():
            live, count = tally["seg_live"].get(sid, [0, 0])
            if (s.live_bytes, s.live_count) != (live, count):
                problems.append(Problem("segment-count", f"segment {sid} live "
                                        f"{s.live_bytes}/{s.live_count}, index says {live}/{count}", fix))
                if fix:
                    s.live_bytes, s.live_count = live, count
                    t.put_segment(sid, s)
        for name, want_v in tally["want"].items():
            have = t.counter(name)
            if have != want_v:
                problems.append(Problem("counter", f"{name} is {have}, index says {want_v}", fix))
                if fix:
                    t.set_counter(name, want_v)
        want: dict[bytes, bytes] = {ck: pack_counts(c) for ck, c in tally["counts"].items()}
        want.update((label_keys_key(label), pack_u64(n)) for label, n in tally["label_keys"].items())
        kept = dict(t.rows("counts"))
        drift = [ck for ck in want.keys() | kept.keys() if want.get(ck) != kept.get(ck)]
        if drift:
            problems.append(Problem("counts", f"{len(drift)} per-namespace/label count record(s) differ from "
                                    "the entries", fix))
            if fix:
                for ck in drift:
                    if ck in want:
                        t.put("counts", ck, want[ck])
                    else:
                        t.delete("counts", ck)
        return problems

    def _keylabels(self, t: Txn, fix: bool) -> list[Problem]:
        """Whether ``keylabels`` is the ``labels`` sub-database turned around (with ``fix``,
        in a write transaction: rebuilt when it is not)."""
        reverse = 0
        missing = 0
        for k in t.keys("labels"):
            label, _, key = k.partition(b"\0")
            reverse += 1
            missing += t.get("keylabels", keylabel_key(key, label)) is None
        extra = t.entries("keylabels") - (reverse - missing)
        if not missing and not extra:
            return []
        if fix:
            t.clear("keylabels")
            for k in t.keys("labels"):
                label, _, key = k.partition(b"\0")
                t.put("keylabels", keylabel_key(key, label), b"")
        return [Problem("counts", f"the labels of {missing + extra} pinned key(s) are not indexed by key", fix)]

    def recount(self, fix: bool) -> list[Problem]:
        """Count every counter, every segment's live bytes and every ``counts`` record again
        from the entries; report (and with ``fix``, correct) those that drifted."""
        if fix:
            def fn(t: Txn) -> list[Problem]:
                first = self._keylabels(t, True)  # first: the label counts are taken through it
                return first + self._compare(t, self._tally(t), True)

            with self.lock:
                return self.index.write(fn)
        with self.index.read() as t:
            return self._keylabels(t, False) + self._compare(t, self._tally(t), False)

    def build_counts(self) -> None:
        """A store of format 1 (no ``counts``, no ``keylabels``): build both from the entries
        and the labels, once, and mark the index as format 2."""
        t0 = self.clock.monotonic()
        self.recount(True)
        self.index.write(lambda t: t.put("meta", META_FORMAT, str(FORMAT_VERSION).encode()))
        log.info("store %s: built the per-namespace and per-label counts of format %d in %.1f s", self.path,
                 FORMAT_VERSION, self.clock.monotonic() - t0)

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
