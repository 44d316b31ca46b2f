"""Eviction: which chunks leave a tier when it needs room, and removing chunks by key.

First go the unpinned chunks of retired namespaces (a model fingerprint that a newer
checkpoint has replaced, see ``Namespaces.retired``), then, by the store's ``eviction``
setting:

``segment`` (the default): whole sealed segments, the cheapest first. A segment's cost is
what evicting it would lose or move: each of its unpinned chunks costs its place in the tier's
LRU order (0 for the least recently used, 1 for the most recent) per byte, each pinned byte
``PIN_COST`` (it must be moved), dead bytes nothing; its benefit is its size less its pinned
bytes; the lowest cost per byte of benefit goes first (cost-benefit cleaning, as in a
log-structured file system, with recency for age). Every unpinned chunk of a chosen segment
goes; its pinned chunks are moved out by compaction (``_fit``), into segments of their own,
and the segment file is removed whole. Live bytes are moved only for pins, so the bytes
written stay close to the bytes put (write amplification near 1 under churn), at a small
cost in hit ratio (benchmarks/churn.py measures both).

``lru``: the least recently used unpinned chunks, one by one; the dead space they leave in
partly live segments is compacted when evicting alone cannot make the room (live bytes moved).

Access times reach the index in batches (``Reads.flush``), so "recent" is as of the last
flush. Pinned chunks are never chosen.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from ..config import TIER_NAMES, StoreConfig
from ..format.record import ALIGN
from ..index import ENTRY_TIER_OFFSET, SEG_SEALED, Entry, Index, Txn, entry_head
from ..index.schema import lru_chunk
from ..tiers.space import Space
from ..types import Evicted
from .compaction import Compactor
from .namespaces import Namespaces

#: what moving a pinned byte out of a chosen segment costs, against losing a hot byte (1)
PIN_COST = 4.0
#: the most chunks of a tier's LRU order the segment policy ranks per eviction
SCAN_MAX = 1 << 18


@dataclass
class Room:
    """A decision to make room in a tier: the bytes to free and the chunks chosen to go
    (``Evictor.choose``); the caller may move them elsewhere before ``Evictor.finish``."""

    tier: str
    tid: int
    incoming: int  # the bytes that must fit, a new segment's header included
    to_free: int
    victims: dict[bytes, Entry] = field(default_factory=dict)
    retired: set[bytes] = field(default_factory=set)  # the victims of retired namespaces
    segments: list[int] = field(default_factory=list)  # segments chosen whole (their pinned chunks move out)

    def ordered(self) -> list[tuple[bytes, Entry]]:
        """The victims in the order of their records on disk (sequential reads)."""
        return sorted(self.victims.items(), key=lambda kv: (kv[1].seg, kv[1].off))


class Evictor:
    """Keeps each tier under its capacity. It decides and drops; it never calls back into
    the write path: moving victims to the next tier down is the caller's (``Writes.make_room``)."""

    def __init__(self, index: Index, space: Space, compactor: Compactor, namespaces: Namespaces,
                 config: Callable[[], StoreConfig], lock: threading.RLock) -> None:
        self.index = index
        self.space = space
        self.compactor = compactor
        self.namespaces = namespaces
        self._config = config
        self.lock = lock

    def retired(self, t: Txn | None = None) -> set[bytes]:
        """The namespaces whose chunks go first (see ``Store.retired_namespaces``)."""
        if t is None:
            with self.index.read() as rt:
                return self.retired(rt)
        return self.namespaces.retired(t, self._config().retire_after_s)

    def make_room(self, tier: str, incoming: int, trim: bool = False) -> int:
        """Evict until ``incoming`` more bytes fit in ``tier``, choosing and dropping the
        victims in one write transaction; returns the chunks evicted. With ``trim``, evict
        down to the low watermark even if they fit already. Dead space in partly live
        segments is compacted when evicting alone cannot make the room. (A tier whose victims
        go elsewhere first is evicted in steps: ``choose``, the move, ``finish``.)"""
        room = self._room(tier, incoming, trim)
        if room is None:
            return 0
        if self._config().eviction == "segment":
            # choosing reads the tier's LRU order: in a read transaction, which holds up no
            # writer; the drop skips what changed meanwhile (moved, evicted, pinned)
            with self.index.read() as t:
                victims, retired, room.segments = self._pick(t, room.tid, room.to_free, False)
            return self._fit(room, self.index.write(lambda t: self._drop(t, tier, victims, retired)))

        def fn(t: Txn) -> int:
            victims, retired, room.segments = self._pick(t, room.tid, room.to_free, False)
            return self._drop(t, tier, victims, retired)

        return self._fit(room, self.index.write(fn))

    def choose(self, tier: str, incoming: int, trim: bool = False, moves: bool = False) -> Room | None:
        """The first step of making room when the victims go somewhere first (the next tier
        down): which chunks would leave ``tier`` (None: ``incoming`` fits already), chosen in a
        read transaction. ``moves``: they move to another local tier, keeping their pins, so
        pinned chunks may be chosen too. The caller moves them (I/O, outside any transaction),
        then calls ``finish``."""
        room = self._room(tier, incoming, trim)
        if room is None:
            return None
        with self.index.read() as t:
            victims, retired, segments = self._pick(t, room.tid, room.to_free, moves)
        return Room(tier, room.tid, room.incoming, room.to_free, victims, retired, segments)

    def finish(self, room: Room) -> int:
        """Drop what ``choose`` picked that is still where it was (a move has taken the rest
        away), then compact if the room is still not there; returns the chunks evicted."""
        n = self.index.write(lambda t: self._drop(t, room.tier, room.victims, room.retired))
        return self._fit(room, n)

    def _room(self, tier: str, incoming: int, trim: bool) -> Room | None:
        st = self.space.tier(tier)
        cap = st.cfg.capacity
        used = self.space.used(tier)
        incoming += ALIGN  # room for a new segment's header
        if used + incoming <= cap and not trim:
            return None
        return Room(tier, st.tid, incoming, used + incoming - int(cap * self._config().low_watermark))

    def _drop(self, t: Txn, tier: str, victims: dict[bytes, Entry], retired: set[bytes]) -> int:
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

    def _fit(self, room: Room, n: int) -> int:
        st = self.space.tier(room.tier)
        cap = st.cfg.capacity
        incoming = room.incoming
        if room.segments:
            # the segments chosen whole: move out what is left in them (pinned chunks, a chunk a
            # spill could not move) and remove their files
            self.compactor.compact_segments(room.tier, room.segments)
        used = self.space.used(room.tier)
        if used + incoming > cap:
            # dead space in partly live segments: reclaim it now (what exact LRU leaves once
            # re-reads make its order depart from the order chunks were written in)
            self.compactor.compact(room.tier, min_dead_ratio=0.0, until_free=used + incoming - cap)
            used = self.space.used(room.tier)
            if used + incoming > cap and st.open_seg is not None:
                self.space.seal_open(st)
                self.compactor.compact(room.tier, min_dead_ratio=0.0, until_free=used + incoming - cap)
        return n

    def _pick(self, t: Txn, tid: int, to_free: int,
              moves: bool) -> tuple[dict[bytes, Entry], set[bytes], list[int]]:
        """The chunks of tier ``tid`` that free ``to_free`` bytes, in eviction order, which of
        them are of retired namespaces, and the segments chosen whole (segment policy)."""
        freed = 0
        retired: set[bytes] = set()
        victims: dict[bytes, Entry] = {}
        segments: list[int] = []
        # a spill that moves chunks (dram to nvme) may take pinned ones: a move keeps the pin
        sources = [(True, self._retired_victims(t, tid, moves))]
        if self._config().eviction == "segment":
            freed = self._take(t, sources, victims, retired, to_free, 0)
            freed = self._segment_victims(t, tid, to_free, moves, victims, freed, segments)
        # exact LRU; for the segment policy, what whole segments could not free (a tier of one
        # open segment, say)
        sources.append((False, self._lru_victims(t, tid, moves)))
        self._take(t, sources, victims, retired, to_free, freed)
        return victims, retired, segments

    @staticmethod
    def _take(t: Txn, sources: list[tuple[bool, Iterator[bytes]]], victims: dict[bytes, Entry],
              retired: set[bytes], to_free: int, freed: int) -> int:
        """Add chunks from ``sources`` (whether they are of retired namespaces, their keys in
        eviction order) to ``victims`` until ``freed`` reaches ``to_free``; returns it."""
        for from_retired, keys in sources:
            for key in keys:
                if freed >= to_free:
                    return freed
                if key in victims:
                    continue
                e = t.entry(key)
                if e is None:
                    continue
                victims[key] = e
                freed += e.rec_len
                if from_retired:
                    retired.add(key)
        return freed

    def _segment_victims(self, t: Txn, tid: int, to_free: int, moves: bool, victims: dict[bytes, Entry],
                         freed: int, segments: list[int]) -> int:
        """Choose whole sealed segments of tier ``tid``, cheapest first (see the module's
        docstring), until ``freed`` reaches ``to_free``; their unpinned chunks (all of them,
        with ``moves``) join ``victims`` and the segments ``segments``. Returns the bytes freed."""
        if freed >= to_free:
            return freed
        # each unpinned chunk costs its place in the tier's LRU order, 0 (the coldest) to 1 (the
        # most recently used), per byte: a segment of cold chunks is cheap to evict whole
        # (on a tier of more than ``SCAN_MAX`` chunks, those beyond it cost 1, as the most recent)
        order: list[tuple[int, int]] = []  # (segment, record length), least recently used first
        for k in t.keys("lru", bytes([tid])):
            if len(order) >= SCAN_MAX:
                break
            key = lru_chunk(k)
            raw = t.entry_raw(key)
            head = None if raw is None else entry_head(raw)
            if head is not None and (moves or not t.pinned(key)):
                order.append((head[0], head[2]))
        name = TIER_NAMES[tid]
        total = max(sum(n for _sid, n in order),
                    t.counter(f"live:{name}") - (0 if moves else t.counter(f"pinned:{name}")), 1)
        rank: dict[int, float] = defaultdict(float)
        ranked: dict[int, int] = defaultdict(int)  # bytes ranked, by segment
        pos = 0
        for sid, n in order:
            rank[sid] += n * (pos + n / 2) / total
            ranked[sid] += n
            pos += n
        # pinned bytes by segment: moving them out costs writes (all but spills, which move anyway)
        pinned: dict[int, int] = defaultdict(int)
        if not moves:
            for k in t.keys("pins"):
                raw = t.entry_raw(bytes(k))
                head = None if raw is None else entry_head(raw)
                if head is not None and head[4] == tid:
                    pinned[head[0]] += head[2]
        cands = []
        for sid, s in t.segments():
            if s.tier != tid or s.state != SEG_SEALED:
                continue
            p = pinned.get(sid, 0)
            unranked = max(0, s.live_bytes - p - ranked.get(sid, 0))
            cost = rank.get(sid, 0.0) + unranked + PIN_COST * p  # dead bytes cost nothing
            cands.append((cost / max(s.size - p, 1), sid))
        cands.sort()
        for _score, sid in cands:
            if freed >= to_free:
                break
            s = t.must_segment(sid)
            freed += s.size
            for key, e in t.entries_in_segment(sid):
                if key in victims:  # counted already (a retired chunk)
                    freed -= e.rec_len
                elif moves or not t.pinned(key):
                    victims[key] = e
                else:
                    freed -= e.rec_len  # moved out by compaction: it takes room again
            segments.append(sid)
        return freed

    def plan(self, tier: str, capacity: int, low_watermark: float,
             moves: bool = False) -> tuple[list[tuple[bytes, int]], bool]:
        """What making room in ``tier`` would take from it were its capacity ``capacity`` and
        the low watermark ``low_watermark``: ``(key, bytes on disk)`` in eviction order, and
        whether they would move to the next tier down rather than be dropped (``moves``: they
        would, as the caller's ``choose`` would be told). Reads only."""
        used = self.space.used(tier)
        if used + ALIGN <= capacity:
            return [], False
        with self.index.read() as t:
            to_free = used + ALIGN - int(capacity * low_watermark)
            victims, _, _ = self._pick(t, self.space.tier(tier).tid, to_free, moves)
        return [(k, e.rec_len) for k, e in victims.items()], moves

    def _lru_victims(self, t: Txn, tier: int, pinned_too: bool = False) -> Iterator[bytes]:
        """Unpinned chunks of ``tier`` (all, with ``pinned_too``), least recently used first."""
        for k in t.keys("lru", bytes([tier])):
            key = lru_chunk(k)
            if pinned_too or not t.pinned(key):
                yield key

    def _retired_victims(self, t: Txn, tier: int, pinned_too: bool = False) -> Iterator[bytes]:
        """Unpinned chunks of retired namespaces in ``tier``."""
        for nid in sorted(self.retired(t)):
            for k, v in t.rows("chunks", nid):
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
                    t.delete("chunks", key)
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
