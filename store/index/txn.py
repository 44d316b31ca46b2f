"""An index transaction (``Txn``): every read and write of LMDB by the other parts, named
records (entries, segments, pins, labels, aliases, counters) and rows of a sub-database
named in ``schema.py``, each keeping the counters and counts in step."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, cast

import lmdb

from ..config import TIER_NAMES
from ..errors import StoreError
from ..format.record import align_up
from .records import (
    _BE64,
    _COUNTS,
    _PIN,
    _U64,
    SEG_SEALED,
    Entry,
    SegmentRecord,
    entry_delta,
    unpack_pin,
)
from .schema import (
    DbName,
    alias_back,
    alias_row,
    counter_key,
    keylabel_key,
    label_count_key,
    label_key,
    label_keys_key,
    loc_key,
    lru_key,
    ns_count_key,
    pack_alias,
    prefix_back,
    prefix_row,
    seg_id,
    seg_key,
    unpack_alias,
)

if TYPE_CHECKING:
    from . import Index

log = logging.getLogger("lmctl.store")


def _successor(prefix: bytes) -> bytes | None:
    """The least key greater than every key that starts with ``prefix`` (None: there is none)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


# -- transactions ------------------------------------------------------------------
class Txn:
    """One index transaction and the operations on records that keep counters in step.

    ``remove`` lists the segment files (tier, id) to delete once the transaction has
    committed; ``on_abort`` registers what to undo outside LMDB if it does not."""

    def __init__(self, index: Index, txn: lmdb.Transaction, write: bool) -> None:
        self.index = index
        self.raw = txn
        self.write = write
        self.remove: list[tuple[str, int]] = []
        self._undo: list[Callable[[], None]] = []

    def on_abort(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    # rows of a sub-database named in store/index/schema.py (keys built there)
    def get(self, db: DbName, key: bytes) -> bytes | None:
        """The value of ``key`` in ``db`` (None: absent). A copy: it outlives the transaction."""
        raw = self.raw.get(key, db=self.index.db(db))
        return None if raw is None else bytes(raw)

    def put(self, db: DbName, key: bytes, value: bytes) -> None:
        self.raw.put(key, value, db=self.index.db(db))

    def delete(self, db: DbName, key: bytes) -> bool:
        """Remove ``key`` from ``db``; whether it was there."""
        return bool(self.raw.delete(key, db=self.index.db(db)))

    def rows(self, db: DbName, prefix: bytes = b"", *, start: bytes | None = None) -> Iterator[tuple[bytes, bytes]]:
        """The (key, value) rows of ``db`` whose key starts with ``prefix``, in key order, from
        ``start`` (a key at or after ``prefix``) when given."""
        cur = self.raw.cursor(db=self.index.db(db))
        if start is None and not prefix:  # transactions hand out bytes (buffers=False)
            return cast("Iterator[tuple[bytes, bytes]]", iter(cur))
        return self._prefixed(cur, prefix, start, True)

    def keys(self, db: DbName, prefix: bytes = b"", *, start: bytes | None = None) -> Iterator[bytes]:
        """The keys of ``db`` that start with ``prefix``, in key order (see ``rows``)."""
        cur = self.raw.cursor(db=self.index.db(db))
        if start is None and not prefix:
            return cast("Iterator[bytes]", cur.iternext(values=False))
        return self._prefixed(cur, prefix, start, False)

    @staticmethod
    def _prefixed(cur: Any, prefix: bytes, start: bytes | None, values: bool) -> Iterator[Any]:
        if not cur.set_range(prefix if start is None else start):
            return
        for row in cur.iternext(values=values):
            k = row[0] if values else row
            if k[: len(prefix)] != prefix:
                return
            yield row

    def rows_newest_first(self, db: DbName, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
        """The rows of ``db`` whose key starts with ``prefix`` (not empty), in reverse key order."""
        cur = self.raw.cursor(db=self.index.db(db))
        upper = _successor(prefix)
        ok = cur.prev() if upper is not None and cur.set_range(upper) else cur.last()
        while ok:
            k = cast(bytes, cur.key())
            if k[: len(prefix)] != prefix:
                if k < prefix:
                    return
                ok = cur.prev()
                continue
            yield k, cast(bytes, cur.value())
            ok = cur.prev()

    def entries(self, db: DbName) -> int:
        """How many rows ``db`` holds."""
        return int(self.raw.stat(self.index.db(db))["entries"])

    def clear(self, db: DbName) -> None:
        """Remove every row of ``db``."""
        self.raw.drop(self.index.db(db), delete=False)

    def _aborted(self) -> None:
        for fn in reversed(self._undo):
            try:
                fn()
            except OSError as exc:
                log.warning("could not undo part of an aborted index transaction: %s", exc)

    # counters (meta ``c:<name>``)
    def counter(self, name: str) -> int:
        raw = self.raw.get(counter_key(name), db=self.index.meta)
        return int(_U64.unpack(raw)[0]) if raw else 0

    def add(self, name: str, delta: int) -> int:
        v = self.counter(name) + delta
        if v < 0:
            log.warning("counter %s went negative (%d); clamping, run verify to recount", name, v)
            v = 0
        self.raw.put(counter_key(name), _U64.pack(v), db=self.index.meta)
        return v

    def set_counter(self, name: str, value: int) -> None:
        self.raw.put(counter_key(name), _U64.pack(value), db=self.index.meta)

    # chunks
    def entry_raw(self, key: bytes) -> bytes | memoryview | None:
        raw: bytes | memoryview | None = self.raw.get(key, db=self.index.chunks)
        return raw

    def entry(self, key: bytes) -> Entry | None:
        """The entry of ``key``; None when absent or when it cannot be decoded."""
        raw = self.raw.get(key, db=self.index.chunks)
        return None if raw is None else Entry.read(raw)

    def pin(self, key: bytes) -> tuple[int, int]:
        """(pin references, reserved bytes) of ``key``."""
        raw = self.raw.get(key, db=self.index.pins)
        return unpack_pin(raw) if raw is not None else (0, 0)

    def pinned(self, key: bytes) -> bool:
        return self.pin(key)[0] > 0

    def segment(self, sid: int) -> SegmentRecord | None:
        raw = self.raw.get(seg_key(sid), db=self.index.segs)
        return None if raw is None else SegmentRecord.unpack(raw)

    def must_segment(self, sid: int) -> SegmentRecord:
        s = self.segment(sid)
        if s is None:
            raise StoreError("index is inconsistent (a segment record is missing); run lmctl verify --fix")
        return s

    def put_segment(self, sid: int, s: SegmentRecord) -> None:
        self.raw.put(seg_key(sid), s.pack(), db=self.index.segs)

    def segments(self) -> list[tuple[int, SegmentRecord]]:
        return [(seg_id(k), SegmentRecord.unpack(v)) for k, v in self.raw.cursor(db=self.index.segs)]

    def drop_segment(self, tier: str, sid: int, s: SegmentRecord, remove_file: bool = True) -> None:
        """Forget a segment; its space leaves the tier's usage, its file goes after commit."""
        self.raw.delete(seg_key(sid), db=self.index.segs)
        self.add(f"used:{tier}", -s.size)
        if remove_file:
            self.remove.append((tier, sid))

    def index_entry(self, key: bytes, e: Entry, prefix: bytes | None = None) -> None:
        """Make ``e`` the entry of ``key`` and count it (segment, tier and pin counters);
        ``prefix``: the id of the token prefix the chunk ends (``keys.prefix_ids``)."""
        self.raw.put(key, e.pack(), db=self.index.chunks)
        if prefix:
            self.raw.put(prefix_row(prefix, key), key, db=self.index.prefixes)
            self.raw.put(prefix_back(key), prefix, db=self.index.prefixes)
        self.raw.put(lru_key(e.tier, e.last_access, key), b"", db=self.index.lru)
        self.raw.put(loc_key(e.seg, e.off), key, db=self.index.locs)
        seg = self.must_segment(e.seg)
        seg.live_bytes += e.rec_len
        seg.live_count += 1
        self.put_segment(e.seg, seg)
        tname = TIER_NAMES[e.tier]
        self.add(f"live:{tname}", e.rec_len)
        self.add(f"count:{tname}", 1)
        refs, reserved = self.pin(key)
        if refs:
            self.add(f"pinned:{tname}", e.rec_len)
            self.add("pin_reserved", -reserved)
            self.raw.put(key, _PIN.pack(refs, 0), db=self.index.pins)
        self._count_entry(key, e, 1, refs > 0)

    def add_aliases(self, key: bytes, aliases: Sequence[tuple[bytes, int]]) -> None:
        """Index ``aliases`` of ``key``: each (partial key, tokens) finds the first ``tokens``
        of ``key``'s record (``keys.boundary_keys``). An alias already held by another chunk
        is left to it. One row per alias, and one row naming them all for ``forget_aliases``."""
        if not self.index.has_aliases or not aliases:
            return
        db = self.index.aliases
        mine = [a for a, tokens in aliases
                if a != key and self.raw.put(alias_row(a), pack_alias(key, tokens), overwrite=False, db=db)]
        if mine:
            back = alias_back(key)
            old = self.raw.get(back, db=db)
            self.raw.put(back, (b"" if old is None else bytes(old)) + b"".join(mine), db=db)

    def alias(self, alias: bytes) -> tuple[bytes, int] | None:
        """The chunk key and token count an alias names (None: none, or a row this code
        did not write)."""
        if not self.index.has_aliases:
            return None
        raw = self.raw.get(alias_row(alias), db=self.index.aliases)
        return None if raw is None else unpack_alias(raw, len(alias))

    def forget_aliases(self, key: bytes) -> int:
        """Drop every alias of ``key`` (its chunk leaves the index); how many."""
        if not self.index.has_aliases:
            return 0
        db = self.index.aliases
        back = alias_back(key)
        raw = self.raw.get(back, db=db)
        if raw is None:
            return 0
        names = bytes(raw)
        self.raw.delete(back, db=db)
        n = len(key)
        for i in range(0, len(names) - n + 1, n):
            alias = names[i : i + n]
            row = self.raw.get(alias_row(alias), db=db)
            if row is not None and bytes(row[:n]) == key:
                self.raw.delete(alias_row(alias), db=db)
        return len(names) // n

    def unindex_entry(self, key: bytes, e: Entry, keep_aliases: bool = False) -> bytes | None:
        """Remove ``key``'s entry ``e`` and uncount it; a sealed segment left with nothing
        live is forgotten and its file removed after commit. Returns the chunk's prefix id
        (for a move, which indexes it again), if it had one. Its aliases go with it, unless
        ``keep_aliases`` (a move or a re-encoding, which indexes the same key again)."""
        self.raw.delete(key, db=self.index.chunks)
        prefix = self.forget_prefix(key)
        if not keep_aliases:
            self.forget_aliases(key)
        self.raw.delete(lru_key(e.tier, e.last_access, key), db=self.index.lru)
        self.raw.delete(loc_key(e.seg, e.off), db=self.index.locs)
        tname = TIER_NAMES[e.tier]
        self.add(f"live:{tname}", -e.rec_len)
        self.add(f"count:{tname}", -1)
        refs, _ = self.pin(key)
        if refs:
            self.add(f"pinned:{tname}", -e.rec_len)
            self.add("pin_reserved", e.rec_len)
            self.raw.put(key, _PIN.pack(refs, e.rec_len), db=self.index.pins)
        self._count_entry(key, e, -1, refs > 0)
        seg = self.segment(e.seg)
        if seg is None:
            return prefix
        # clamped: an index entry damaged on disk may overstate what it counted (recount fixes it)
        seg.live_bytes = max(0, seg.live_bytes - e.rec_len)
        seg.live_count = max(0, seg.live_count - 1)
        if seg.live_count <= 0 and seg.state == SEG_SEALED:
            self.drop_segment(tname, e.seg, seg)
        else:
            self.put_segment(e.seg, seg)
        return prefix

    def event(self, kind: str, reason: str, keys: list[bytes] | tuple[bytes, ...] = (), **fields: Any) -> None:
        """Add an event to the store's event log in this transaction (``store/index/events.py``);
        nothing when the store keeps none (an index opened on its own)."""
        log_ = self.index.event_log
        if log_ is not None:
            log_.add(self, kind, reason, keys, **fields)

    def forget_prefix(self, key: bytes) -> bytes | None:
        """Drop the ``prefixes`` rows of ``key``; its prefix id, if it had one."""
        raw = self.raw.get(prefix_back(key), db=self.index.prefixes)
        if raw is None:
            return None
        prefix = bytes(raw)
        self.raw.delete(prefix_back(key), db=self.index.prefixes)
        self.raw.delete(prefix_row(prefix, key), db=self.index.prefixes)
        return prefix

    # counts (the ``counts`` sub-database) and the labels of a key (``keylabels``)
    def bump(self, ck: bytes, delta: Sequence[int], sign: int = 1) -> None:
        """Add ``sign * delta`` to the ``Counts`` record ``ck`` (a record at zero is removed)."""
        raw = self.raw.get(ck, db=self.index.counts)
        cur = list(_COUNTS.unpack(raw)) if raw is not None and len(raw) == _COUNTS.size else [0] * 6
        for i, d in enumerate(delta):
            cur[i] += sign * d
        if min(cur) < 0:
            log.warning("count %r went negative (%s); clamping, run verify to recount", ck, cur)
            cur = [max(0, v) for v in cur]
        if any(cur):
            self.raw.put(ck, _COUNTS.pack(*cur), db=self.index.counts)
        elif raw is not None:
            self.raw.delete(ck, db=self.index.counts)

    def _bump_u64(self, ck: bytes, delta: int) -> None:
        raw = self.raw.get(ck, db=self.index.counts)
        v = max(0, (int(_U64.unpack(raw)[0]) if raw is not None and len(raw) == _U64.size else 0) + delta)
        if v:
            self.raw.put(ck, _U64.pack(v), db=self.index.counts)
        elif raw is not None:
            self.raw.delete(ck, db=self.index.counts)

    def labels_of(self, key: bytes) -> list[bytes]:
        """The labels that pin ``key``."""
        out: list[bytes] = []
        cur = self.raw.cursor(db=self.index.keylabels)
        if cur.set_range(key):
            for k in cur.iternext(values=False):
                if k[: len(key)] != key:
                    break
                out.append(bytes(k[len(key):]))
        return out

    def _count_entry(self, key: bytes, e: Entry, sign: int, pinned: bool) -> None:
        d = entry_delta(e, pinned)
        self.bump(ns_count_key(key[:16], e.tier), d, sign)
        if pinned:
            for label in self.labels_of(key):
                self.bump(label_count_key(label, key[:16], e.tier), d, sign)

    def pin_label(self, label: bytes, key: bytes, expected: int) -> bool:
        """Pin ``key`` under ``label`` (False: it already was). A key not stored yet reserves
        ``expected`` bytes (rounded up to whole blocks) until it arrives."""
        lk = label_key(label, key)
        if self.raw.get(lk, db=self.index.labels) is not None:
            return False
        self.raw.put(lk, _BE64.pack(int(self.index.clock.time())), db=self.index.labels)
        self.raw.put(keylabel_key(key, label), b"", db=self.index.keylabels)
        self._bump_u64(label_keys_key(label), 1)
        refs, reserved = self.pin(key)
        e = self.entry(key)
        if refs == 0:
            if e is not None:
                self.add(f"pinned:{e.tier_name}", e.rec_len)
                self.bump(ns_count_key(key[:16], e.tier), (0, 0, 0, 1, e.stored_len, e.rec_len))
            else:
                reserved = align_up(expected) if expected else 0
                self.add("pin_reserved", reserved)
        if e is not None:
            self.bump(label_count_key(label, key[:16], e.tier), entry_delta(e, True))
        self.raw.put(key, _PIN.pack(refs + 1, reserved), db=self.index.pins)
        return True

    def unpin_label(self, label: bytes, key: bytes) -> bool:
        """Drop ``label``'s pin on ``key`` (False: it had none)."""
        if not self.raw.delete(label_key(label, key), db=self.index.labels):
            return False
        self.raw.delete(keylabel_key(key, label), db=self.index.keylabels)
        self._bump_u64(label_keys_key(label), -1)
        e = self.entry(key)
        if e is not None:
            self.bump(label_count_key(label, key[:16], e.tier), entry_delta(e, True), -1)
        raw = self.raw.get(key, db=self.index.pins)
        if raw is None:
            return True
        refs, reserved = unpack_pin(raw)
        if refs <= 1:
            self.raw.delete(key, db=self.index.pins)
            if e is not None:
                self.add(f"pinned:{e.tier_name}", -e.rec_len)
                self.bump(ns_count_key(key[:16], e.tier), (0, 0, 0, 1, e.stored_len, e.rec_len), -1)
            else:
                self.add("pin_reserved", -reserved)
        else:
            self.raw.put(key, _PIN.pack(refs - 1, reserved), db=self.index.pins)
        return True

    def touch_entry(self, key: bytes, last_access: float, hits: int) -> None:
        """Move ``key`` in LRU order to ``last_access`` (never back) and add ``hits``."""
        raw = self.raw.get(key, db=self.index.chunks)
        e = None if raw is None else Entry.read(raw)
        if e is None:
            return
        self.raw.delete(lru_key(e.tier, e.last_access, key), db=self.index.lru)
        e.last_access = max(e.last_access, last_access)
        e.hits += hits
        self.raw.put(key, e.pack(), db=self.index.chunks)
        self.raw.put(lru_key(e.tier, e.last_access, key), b"", db=self.index.lru)

    def entries_in_segment(self, sid: int) -> list[tuple[bytes, Entry]]:
        """The chunks indexed in segment ``sid``, in offset order."""
        lo = seg_key(sid)
        cur = self.raw.cursor(db=self.index.locs)
        out = []
        if cur.set_range(lo):
            for k, v in cur:
                if k[:8] != lo:
                    break
                e = self.entry(bytes(v))
                if e is not None:
                    out.append((bytes(v), e))
        return out
