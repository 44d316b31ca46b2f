"""The check: every entry against its segment file (``deep``: its bytes too), the counters and
per-namespace/label counts recounted in one paged pass over the index, ``fix`` repairing what it
finds; and the counts of a format-1 store built by the same pass. What recovery at open and
after a lost index does is in ``recovery.py``, which the check asks about absent tiers and
unknown files.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from ..clock import SYSTEM_CLOCK, Clock
from ..config import TIER_NAMES
from ..format.codec import CODEC_NAMES
from ..format.keys import KEY_BYTES, short_key
from ..format.record import ALIGN, MAX_CHUNK_BYTES
from ..format.segment import CorruptRecord, SegmentGone
from ..index import (
    ENTRY_SIZE,
    FORMAT_VERSION,
    Entry,
    Index,
    Txn,
    entry_dtype,
    entry_head,
    pack_counts,
    pack_u64,
    trailer_mismatch,
    unpack_pin,
)
from ..index.schema import META_FORMAT, keylabel_key, label_count_key, label_keys_key
from ..tiers.space import Space
from ..types import Problem
from .recovery import Recovery

log = logging.getLogger("lmctl.store")

#: entries per progress report of a pass over the index
PROGRESS_EVERY = 4096
#: entries decoded at once by a pass over the index
TALLY_PAGE = 8192
#: entries read per transaction by the deep check (no snapshot is held while records are read)
DEEP_PAGE = 512


class Checker:
    """Checks the index against the segment files, recounts, builds the counts."""

    def __init__(self, index: Index, space: Space, recovery: Recovery, lock: threading.RLock, *,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.index = index
        self.tiers = space.tiers
        self.recovery = recovery
        self.lock = lock
        self.clock = clock

    # -- check -----------------------------------------------------------------------------
    def check(self, fix: bool = False, deep: bool = False,
              progress: Callable[[int, int], None] | None = None) -> list[Problem]:
        """See ``Store.check``. One pass over the entries in one snapshot checks each against
        the segments and their files and recounts every counter (memory: the counts, not the
        entries); ``deep`` then reads every record, a page of entries per short transaction."""
        problems: list[Problem] = []
        absent = self.recovery.absent_tiers()
        problems.extend(Problem("tier-unavailable", self.recovery.absent_message(name)) for name in sorted(absent))
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
            problems.extend(self.recovery.remove_orphan_files())
        else:
            problems.extend(self.recovery.unknown_problem(st, sid) for st, sid in self.recovery.unknown_files())
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
        log.info("store %s: built the per-namespace and per-label counts of format %d in %.1f s", self.recovery.path,
                 FORMAT_VERSION, self.clock.monotonic() - t0)
