"""Eviction: which chunks leave a tier when it needs room, and removing chunks by key.

The order is fixed (it is not a setting): first the unpinned chunks of retired
namespaces (a model fingerprint that a newer checkpoint has replaced, see
``Namespaces.retired``), then the least recently used unpinned chunks. Access times
reach the index in batches (``Reads.flush``), so "recent" is as of the last flush.
Pinned chunks are never chosen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Iterator

from .compaction import Compactor
from .config import StoreConfig
from .errors import StoreError
from .index import ENTRY_TIER_OFFSET, Entry, Index, Txn, lru_chunk
from .namespaces import Namespaces
from .segment import ALIGN
from .space import Space
from .types import Evicted

log = logging.getLogger("lmctl.store")


class Evictor:
    """Keeps each tier under its capacity."""

    def __init__(self, index: Index, space: Space, compactor: Compactor, namespaces: Namespaces,
                 config: Callable[[], StoreConfig], lock: threading.RLock) -> None:
        self.index = index
        self.space = space
        self.compactor = compactor
        self.namespaces = namespaces
        self._config = config
        self.lock = lock
        #: where a tier's victims go before they are dropped (dram -> nvme, nvme -> the remote
        #: tier with write "evict"); None: they are dropped
        self.spill: Callable[[str, list[tuple[bytes, Entry]]], object] | None = None
        #: whether the spill of a tier moves its victims to another local tier (keeping them)
        self.spill_moves: Callable[[str], bool] | None = None

    def retired(self, t: Txn | None = None) -> set[bytes]:
        """The namespaces whose chunks go first (see ``Store.retired_namespaces``)."""
        if t is None:
            with self.index.read() as rt:
                return self.retired(rt)
        return self.namespaces.retired(t, self._config().retire_after_s)

    def make_room(self, tier: str, incoming: int, trim: bool = False) -> int:
        """Evict until ``incoming`` more bytes fit in ``tier``; returns the chunks evicted.
        With ``trim``, evict down to the low watermark even if they fit already. Dead space
        in partly live segments is compacted when evicting alone cannot make the room."""
        st = self.space.tier(tier)
        cap = st.cfg.capacity
        used = self.space.used(tier)
        incoming += ALIGN  # room for a new segment's header
        if used + incoming <= cap and not trim:
            return 0
        to_free = used + incoming - int(cap * self._config().low_watermark)

        moves = self.spill is not None and self.spill_moves is not None and self.spill_moves(tier)

        def pick(t: Txn) -> tuple[dict[bytes, Entry], set[bytes]]:
            return self._pick(t, st.tid, to_free, moves)

        def drop(t: Txn, victims: dict[bytes, Entry], retired: set[bytes]) -> int:
            gone: dict[str, list[bytes]] = {"retired": [], "lru": []}
            nbytes = {"retired": 0, "lru": 0}
            for key, e in victims.items():
                cur = t.entry(key)  # still where it was picked (a spill moves it; then it stays)
                if cur is not None and (cur.seg, cur.off, cur.tier) == (e.seg, e.off, e.tier) and not t.pinned(key):
                    t.unindex_entry(key, cur)
                    why = "retired" if key in retired else "lru"
                    gone[why].append(key)
                    nbytes[why] += cur.rec_len
            n = len(gone["retired"]) + len(gone["lru"])
            t.add("evicted_retired", len(gone["retired"]))
            t.add("evicted", n)
            for why, keys in gone.items():
                if keys:
                    t.event("evict", why, keys, tier=tier, bytes=nbytes[why])
            return n

        if self.spill is None:
            def fn(t: Txn) -> int:
                victims, retired = pick(t)
                return drop(t, victims, retired)

            n = self.index.write(fn)
        else:
            # victims go to the next tier down first (outside any transaction: it is I/O),
            # then whatever is still where it was is dropped
            with self.index.read() as t:
                victims, retired = pick(t)
            if victims:
                try:
                    self.spill(tier, sorted(victims.items(), key=lambda kv: (kv[1].seg, kv[1].off)))
                except (StoreError, OSError) as exc:  # the next tier is full or failing: evict
                    log.warning("could not move %d chunk(s) out of tier %s (%s); evicting them", len(victims),
                                tier, exc)
            n = self.index.write(lambda t: drop(t, victims, retired))
        used = self.space.used(tier)
        if used + incoming > cap:
            # dead space in partly live segments: reclaim it now (rare with LRU, since
            # old segments die whole)
            self.compactor.compact(tier, min_dead_ratio=0.0, until_free=used + incoming - cap)
            used = self.space.used(tier)
            if used + incoming > cap and st.open_seg is not None:
                self.space.seal_open(st)
                self.compactor.compact(tier, min_dead_ratio=0.0, until_free=used + incoming - cap)
        return n

    def _pick(self, t: Txn, tid: int, to_free: int, moves: bool) -> tuple[dict[bytes, Entry], set[bytes]]:
        """The chunks of tier ``tid`` that free ``to_free`` bytes, in eviction order, and which of
        them are of retired namespaces."""
        freed = 0
        retired: set[bytes] = set()
        victims: dict[bytes, Entry] = {}
        # a spill that moves chunks (dram to nvme) may take pinned ones: a move keeps the pin
        sources = ((True, self._retired_victims(t, tid, moves)), (False, self._lru_victims(t, tid, moves)))
        for from_retired, keys in sources:
            for key in keys:
                if freed >= to_free:
                    break
                if key in victims:
                    continue
                e = t.entry(key)
                if e is None:
                    continue
                victims[key] = e
                freed += e.rec_len
                if from_retired:
                    retired.add(key)
        return victims, retired

    def plan(self, tier: str, capacity: int, low_watermark: float) -> tuple[list[tuple[bytes, int]], bool]:
        """What ``make_room(tier, 0)`` would take from ``tier`` were its capacity ``capacity``
        and the low watermark ``low_watermark``: ``(key, bytes on disk)`` in eviction order, and
        whether they would move to the next tier down rather than be dropped. Reads only."""
        used = self.space.used(tier)
        if used + ALIGN <= capacity:
            return [], False
        moves = self.spill is not None and self.spill_moves is not None and self.spill_moves(tier)
        with self.index.read() as t:
            victims, _ = self._pick(t, self.space.tier(tier).tid, used + ALIGN - int(capacity * low_watermark), moves)
        return [(k, e.rec_len) for k, e in victims.items()], moves

    def _lru_victims(self, t: Txn, tier: int, pinned_too: bool = False) -> Iterator[bytes]:
        """Unpinned chunks of ``tier`` (all, with ``pinned_too``), least recently used first."""
        cur = t.raw.cursor(db=self.index.lru)
        prefix = bytes([tier])
        if not cur.set_range(prefix):
            return
        for k in cur.iternext(values=False):
            if k[:1] != prefix:
                return
            key = lru_chunk(k)
            if pinned_too or not t.pinned(key):
                yield key

    def _retired_victims(self, t: Txn, tier: int, pinned_too: bool = False) -> Iterator[bytes]:
        """Unpinned chunks of retired namespaces in ``tier``."""
        for nid in sorted(self.retired(t)):
            cur = t.raw.cursor(db=self.index.chunks)
            if not cur.set_range(nid):
                continue
            for k, v in cur:
                if not bytes(k).startswith(nid):
                    break
                if v[ENTRY_TIER_OFFSET] != tier:
                    continue
                key = bytes(k)
                if pinned_too or not t.pinned(key):
                    yield key

    def evict(self, keys: Iterable[bytes], force: bool = False, reason: str = "operator",
              uid: int | None = None) -> Evicted:
        """See ``Store.evict``."""

        def fn(t: Txn) -> Evicted:
            n = b = 0
            gone: list[bytes] = []
            for key in keys:
                raw = t.entry_raw(key)
                if raw is None:
                    continue
                if not force and t.pinned(key):
                    continue
                e = Entry.read(raw)
                if e is None:  # a damaged entry: forget it (verify --fix recounts what it counted)
                    t.raw.delete(key, db=self.index.chunks)
                    t.forget_prefix(key)
                    n += 1
                    gone.append(key)
                    continue
                t.unindex_entry(key, e)
                n += 1
                b += e.rec_len
                gone.append(key)
            t.add("evicted", n)
            if gone:
                t.event("evict", reason, gone, bytes=b, uid=uid, force=force or None)
            return Evicted(n, b)

        with self.lock:
            return self.index.write(fn)
