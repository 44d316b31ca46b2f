"""Compaction: rewrite the live records of mostly-dead sealed segments elsewhere, then
remove the segments whole. Segment ids are never reused and indexed bytes never
overwritten, so a reader racing a compaction reads either the old bytes (still valid)
or no file, and then looks the key up again."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

from ..config import StoreConfig
from ..format.record import ALIGN, encode_trailer
from ..format.segment import CorruptRecord, SegmentGone
from ..index import SEG_SEALED, Index, Txn, drop_corrupt, trailer_mismatch
from ..tiers.space import Space, TierState
from ..types import Compacted


class Compactor:
    """Reclaims the dead space of sealed segments."""

    def __init__(self, index: Index, space: Space, config: Callable[[], StoreConfig], lock: threading.RLock) -> None:
        self.index = index
        self.space = space
        self._config = config
        self.lock = lock

    def compact(self, tier: str | None = None, min_dead_ratio: float | None = None,
                until_free: int | None = None) -> Compacted:
        """See ``Store.compact``."""
        ratio = self._config().compact_dead_ratio if min_dead_ratio is None else min_dead_ratio
        names = [tier] if tier else list(self.space.tiers)
        removed = reclaimed = 0
        for tname in names:
            st = self.space.tier(tname)
            with self.index.read() as t:
                cands = []
                for sid, s in t.segments():
                    if s.tier != st.tid or s.state != SEG_SEALED or sid == st.open_seg:
                        continue
                    dead = s.size - s.live_bytes - ALIGN
                    if dead > 0 and dead >= ratio * s.size:
                        cands.append((dead, sid, s.size))
            cands.sort(reverse=True)
            for _dead, sid, size in cands:
                if until_free is not None and reclaimed >= until_free:
                    break
                if self._compact_segment(st, sid):
                    removed += 1
                    reclaimed += size
        return Compacted(removed, reclaimed)

    def compact_segments(self, tier: str, sids: list[int]) -> Compacted:
        """Move what is still live in segments ``sids`` of ``tier`` elsewhere and remove them
        (eviction's segment policy chose them whole); a segment already gone is skipped."""
        st = self.space.tier(tier)
        removed = reclaimed = 0
        with self.index.read() as t:
            todo = [(sid, s) for sid, s in ((sid, t.segment(sid)) for sid in sids)
                    if s is not None and s.tier == st.tid and s.state == SEG_SEALED]
        # what moves (pinned chunks, mostly) goes to segments of its own, apart from new chunks:
        # pinned chunks end up together, in segments no eviction needs to touch again
        moving = any(s.live_count for _sid, s in todo)
        if moving:
            self.space.seal_open(st)
        for sid, s in todo:
            if self._compact_segment(st, sid):
                removed += 1
                reclaimed += s.size
        if moving:
            self.space.seal_open(st)
        return Compacted(removed, reclaimed)

    def _compact_segment(self, st: TierState, sid: int) -> bool:
        with self.lock:
            with self.index.read() as t:
                live = [(e.off, key) for key, e in t.entries_in_segment(sid)]
            for off, key in live:
                self._move(st, sid, off, key)
            # the segment may still hold records of keys that were re-put elsewhere; when
            # nothing live is left it is removed by unindex_entry; make sure here too

            def finish(t: Txn) -> bool:
                s = t.segment(sid)
                if s is None:
                    return True
                if s.live_count > 0:
                    return False
                t.drop_segment(st.name, sid, s)
                return True

            return self.index.write(finish)

    def _move(self, st: TierState, sid: int, off: int, key: bytes) -> None:
        """Copy one live record of segment ``sid`` into this process's open segment and
        point its entry there (if nothing moved or replaced it meanwhile)."""
        with self.index.read() as t:
            e = t.entry(key)
        if e is None or (e.seg, e.off) != (sid, off):
            return
        buf = st.io.pool.take(e.stored_len)
        data = memoryview(buf)[: e.stored_len]
        try:
            trailer = st.io.read_record(sid, off, e.stored_len, data)
        except (CorruptRecord, SegmentGone, ValueError) as exc:
            st.io.pool.give(buf)
            drop_corrupt(self.index, key, e, detail=f"found by compaction: {exc}")
            return
        wrong = trailer_mismatch(key, e, trailer)
        if wrong:
            st.io.pool.give(buf)
            drop_corrupt(self.index, key, e, detail=f"found by compaction: the index and the record trailer "
                                                    f"disagree on {wrong}")
            return
        # reserve in our own open segment, without evicting (compaction frees space)
        nseg, noff, fd = self.index.write(lambda t: self.space.alloc(t, st, e.rec_len))
        try:
            n, _csum = st.io.write_record(fd, noff, data, functools.partial(
                encode_trailer, key, trailer.codec, trailer.meta, trailer.stored_len, trailer.raw_len,
                created=trailer.created))
        finally:
            st.io.pool.give(buf)
        if self._config().fsync:
            st.io.sync(fd)
        self.space.close_retired(st)

        def move(t: Txn) -> None:
            t.add("written_bytes", n)
            t.add("compacted_bytes", n)
            cur = t.entry(key)
            if cur is None or (cur.seg, cur.off) != (sid, off):
                return
            prefix = t.unindex_entry(key, cur, keep_aliases=True)
            cur.seg, cur.off = nseg, noff
            t.index_entry(key, cur, prefix)  # a move is not an eviction: pins stay as they were

        self.index.write(move)

