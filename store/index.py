"""The index: LMDB's sub-databases, the records kept in them, their keys, and transactions.

This module is the only one that opens LMDB and reads or writes it: every other part goes
through a ``Txn`` (named records such as ``Txn.entry`` and ``Txn.pin_label``, or rows of a
sub-database named in ``store/schema.py``, which declares every sub-database and key).

``counts`` is kept in step with ``chunks`` by the same transactions (``Txn.index_entry``,
``unindex_entry``, ``pin_label``, ``unpin_label``), so operator statistics never scan the
chunks; ``Store.check`` recounts it. Stores of format 1 had no ``counts``/``keylabels``:
they are built once when such a store is first opened for writing (then format 2).

Every write goes through ``Index.transact()``: it hands out a ``Txn`` that carries the
LMDB transaction, the segment files to remove once it has committed, and what to undo
outside LMDB (a segment file created in it) if it aborts. The map is grown in one place,
before a write transaction starts, so no transaction function is ever replayed with
side effects it already had.

Durability. LMDB runs with ``sync=True, metasync=False``: a commit writes its pages and
fdatasyncs them, then writes the meta page that makes it current without syncing it, so a
power cut may undo the last commit (never more: the next commit's fdatasync, of any process,
takes that meta page down with its own pages), and can never tear the index. A commit whose
result is acknowledged as durable (``write(fn, durable=True)``: pins, labels, settings,
namespace records, engine puts with ``fsync``) is followed by ``Index.sync()``, one more
fdatasync that makes its meta page durable before the caller returns. An engine put's
commit is made durable within ``SYNC_SOON_S`` instead (``Index.sync_soon``: one background
sync for every commit in that time, not one more fdatasync per batch). Files are removed only
after the commit that forgets them is synced, so a cut never leaves the index naming a file
that is gone.
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast

import lmdb

from .clock import SYSTEM_CLOCK, Clock
from .codec import CODEC_NAMES
from .config import TIER_NAMES
from .errors import CorruptEntry, IndexReopened, IndexWriteError, ReadOnlyError, StoreError, is_read_only
from .private import DIR_MODE
from .schema import (  # noqa: F401 (the key builders are the index's too)
    COUNT_LABEL,
    COUNT_LABEL_KEYS,
    COUNT_NS,
    DB_NAMES,
    DbName,
    alias_back,
    alias_row,
    counter_key,
    keylabel_key,
    label_count_key,
    label_key,
    label_keys_key,
    loc_key,
    lru_chunk,
    lru_key,
    ns_count_key,
    pack_alias,
    prefix_back,
    prefix_row,
    seg_id,
    seg_key,
    unpack_alias,
)
from .segment import ALIGN, MAX_CHUNK_BYTES, RecordTrailer, align_up, record_len
from .types import Origin

if TYPE_CHECKING:
    from .events import EventLog

log = logging.getLogger("lmctl.store")
T = TypeVar("T")

#: the map the index starts with; LMDB only reserves address space for it
MAP_SIZE = 64 << 30
#: the map grows (doubles) before a write transaction once this share of it is in use
GROW_AT = 0.5
#: a commit left to ``Index.sync_soon`` (engine puts) is synced this long after it, at most
SYNC_SOON_S = 1.0
FORMAT_VERSION = 2
#: ``Entry.origin``: a chunk this store's engines computed, or one promoted from the remote tier
ORIGIN_LOCAL, ORIGIN_REMOTE = 0, 1
#: formats this lmctl opens (a format-1 store gets its counts built at its first writable open)
FORMATS = (1, 2)

# chunks: key -> entry (+ layout JSON)
_ENTRY_HEAD = "<6Q2IB"  # seg, off, rec_len, stored_len, raw_len, checksum; tokens, hits; codec
# then tier, level, origin (0: computed here, 1: promoted from the remote tier), the writer id
# the remote head named, created, last_access (origin and writer were 5 bytes of padding: an
# entry written before they were is an entry of a chunk computed here)
_ENTRY = struct.Struct(_ENTRY_HEAD + "BBBIdd")
ENTRY_TIER_OFFSET = struct.calcsize(_ENTRY_HEAD)  # the tier byte, read without unpacking an entry
ENTRY_CODEC_OFFSET = struct.calcsize(_ENTRY_HEAD[:-1])  # the codec byte, likewise
ENTRY_SIZE = _ENTRY.size  # the packed part of an entry (its layout JSON follows)
# segs: seg id (BE) -> segment record
_SEGMENT = struct.Struct("<BBxxIQQQd")
SEG_OPEN, SEG_SEALED = 0, 1
# pins: key -> refs, reserved bytes (expected size while the chunk is not stored)
_PIN = struct.Struct("<IQ")
_U64 = struct.Struct("<Q")
# counts: chunks, stored bytes, disk bytes, pinned chunks, pinned stored bytes, pinned disk bytes
_COUNTS = struct.Struct("<6Q")
_BE64 = struct.Struct(">Q")


def pack_counts(c: tuple[int, ...] | list[int]) -> bytes:
    return _COUNTS.pack(*c)


def unpack_counts(raw: bytes | memoryview) -> tuple[int, ...]:
    return tuple(_COUNTS.unpack(raw))


def entry_delta(e: Entry, pinned: bool) -> tuple[int, int, int, int, int, int]:
    """What one chunk adds to a ``counts`` record."""
    return (1, e.stored_len, e.rec_len) + ((1, e.stored_len, e.rec_len) if pinned else (0, 0, 0))


def pack_u64(v: int) -> bytes:
    return _U64.pack(v)


def pack_be64(v: int) -> bytes:
    return _BE64.pack(v)


def pack_pin(refs: int, reserved: int) -> bytes:
    return _PIN.pack(refs, reserved)


def unpack_pin(raw: bytes | memoryview) -> tuple[int, int]:
    refs, reserved = _PIN.unpack(raw)
    return int(refs), int(reserved)


# -- records -----------------------------------------------------------------------
@dataclass
class Entry:
    """Where a chunk is and what it is: one value of the ``chunks`` sub-database."""

    seg: int
    off: int
    rec_len: int
    stored_len: int
    raw_len: int
    checksum: int
    tokens: int
    hits: int
    codec: int
    tier: int
    created: float
    last_access: float
    layout: dict[str, Any]
    level: int = 0  # the codec level it was encoded at (0: raw, or written before levels were recorded)
    origin: int = 0  # ORIGIN_LOCAL or ORIGIN_REMOTE
    writer: int = 0  # of a chunk from the remote tier: the writer id its head named (0: none)

    def pack(self) -> bytes:
        return _ENTRY.pack(self.seg, self.off, self.rec_len, self.stored_len, self.raw_len,
                           self.checksum, self.tokens, self.hits, self.codec, self.tier, self.level,
                           self.origin, self.writer, self.created, self.last_access) + json.dumps(
                               self.layout, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Entry:
        """Decode an entry; ``CorruptEntry`` if it does not make sense."""
        try:
            f = _ENTRY.unpack_from(raw, 0)
            layout = json.loads(bytes(raw[_ENTRY.size:]) or b"{}")
        except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptEntry(f"unreadable index entry: {exc}") from None
        if f[9] not in TIER_NAMES or f[8] not in CODEC_NAMES or not isinstance(layout, dict):
            raise CorruptEntry(f"index entry names tier {f[9]} and codec {f[8]}")
        if not (0 <= f[13] < 1.8e10 and 0 <= f[14] < 1.8e10):  # NaN fails too
            raise CorruptEntry("index entry has impossible times")
        if max(f[2], f[3], f[4]) >= MAX_CHUNK_BYTES or f[1] % ALIGN or f[2] % ALIGN:
            raise CorruptEntry("index entry has impossible lengths or offsets")
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[13], f[14], layout, f[10], f[11],
                   f[12])

    @classmethod
    def read(cls, raw: bytes | memoryview) -> Entry | None:
        """``unpack``, or None for an entry that cannot be decoded (a damaged index)."""
        try:
            return cls.unpack(raw)
        except CorruptEntry:
            return None

    @property
    def tier_name(self) -> str:
        return TIER_NAMES[self.tier]


def origin_of(e: Entry) -> Origin | None:
    """Where the chunk of ``e`` came from (None: computed by this store's engines)."""
    return None if e.origin == ORIGIN_LOCAL else Origin("remote", e.writer, e.created)


@functools.cache
def entry_dtype() -> Any:
    """The packed part of an entry as a numpy record (for passes that decode many at once)."""
    import numpy as np

    dt = np.dtype([("seg", "<u8"), ("off", "<u8"), ("rec", "<u8"), ("stored", "<u8"), ("raw", "<u8"),
                   ("checksum", "<u8"), ("tokens", "<u4"), ("hits", "<u4"), ("codec", "u1"), ("tier", "u1"),
                   ("level", "u1"), ("origin", "u1"), ("writer", "<u4"), ("created", "<f8"), ("last", "<f8")])
    assert dt.itemsize == _ENTRY.size
    return dt


def entry_head(raw: bytes | memoryview) -> tuple[int, int, int, int, int] | None:
    """(segment, offset, record length, stored length, tier) of a packed entry, checked as
    ``Entry.unpack`` checks it but without decoding its layout (only that it is framed as a
    JSON object): what a pass over every entry needs, at a fraction of the cost. None for an
    entry that cannot be decoded."""
    try:
        f = _ENTRY.unpack_from(raw, 0)
    except struct.error:
        return None
    n = len(raw)
    if n > _ENTRY.size and (raw[_ENTRY.size] != 0x7B or raw[n - 1] != 0x7D):  # { ... }
        return None
    if f[9] not in TIER_NAMES or f[8] not in CODEC_NAMES or not (0 <= f[13] < 1.8e10 and 0 <= f[14] < 1.8e10):
        return None
    if max(f[2], f[3], f[4]) >= MAX_CHUNK_BYTES or f[1] % ALIGN or f[2] % ALIGN:
        return None
    return f[0], f[1], f[2], f[3], f[9]


@dataclass
class SegmentRecord:
    """What the index knows of one segment file: one value of the ``segs`` sub-database."""

    tier: int
    state: int
    pid: int
    size: int
    live_bytes: int
    live_count: int
    created: float

    def pack(self) -> bytes:
        return _SEGMENT.pack(self.tier, self.state, self.pid, self.size, self.live_bytes,
                             self.live_count, self.created)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> SegmentRecord:
        return cls(*_SEGMENT.unpack(raw))

    @property
    def dead_bytes(self) -> int:
        """Bytes of records nothing points to any more (the segment's own header aside)."""
        return max(0, self.size - self.live_bytes - ALIGN)


def trailer_mismatch(key: bytes, e: Entry, trailer: RecordTrailer) -> str | None:
    """What an index entry and its record's checksummed trailer disagree on, if anything.
    LMDB keeps no checksums of its own, so every read checks the entry against the trailer."""
    meta = trailer.meta if isinstance(trailer.meta, dict) else None
    layout = meta.get("layout", {}) if meta is not None else None
    tokens = meta.get("tokens", 0) if meta is not None else None
    if e.rec_len != record_len(e.stored_len):
        return "the record length"
    for what, ours, theirs in (("the key", key, trailer.key), ("the checksum", e.checksum, trailer.checksum),
                               ("the codec", e.codec, trailer.codec),
                               ("the stored length", e.stored_len, trailer.stored_len),
                               ("the raw length", e.raw_len, trailer.raw_len), ("the layout", e.layout, layout),
                               ("the token count", e.tokens, tokens)):
        if ours != theirs:
            return what
    return None


def _successor(prefix: bytes) -> bytes | None:
    """The least key greater than every key that starts with ``prefix`` (None: there is none)."""
    p = prefix.rstrip(b"\xff")
    return p[:-1] + bytes([p[-1] + 1]) if p else None


class _MapGrown(IndexWriteError):
    """A write transaction found the map full; it was aborted and the map has grown."""


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

    # rows of a sub-database named in store/schema.py (keys built there)
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
        """Add an event to the store's event log in this transaction (``store/events.py``);
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


class Index:
    """The LMDB environment of a store and its sub-databases."""

    def __init__(self, path: str, readonly: bool, remove_files: Callable[[list[tuple[str, int]]], None], *,
                 event_log_max: Callable[[], int] | None = None, readonly_reason: str | None = None,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """Open the environment at ``path``. ``remove_files`` removes the segment files a
        commit forgot; ``event_log_max`` bounds the event log ``Txn.event`` writes to (None:
        the index keeps none, e.g. an index opened on its own); ``readonly_reason`` says why
        an index opened ``readonly`` is (default: it was asked to be); ``clock``: what
        pin times and event times are read from."""
        self.path = path
        self.clock = clock
        self.readonly = readonly
        self.remove_files = remove_files
        self._pid = os.getpid()
        self._closed = False
        self._grow_lock = threading.Lock()
        # the background sync of ``sync_soon``: its timer, and whether a commit is not synced yet
        self._sync_lock = threading.Lock()
        self._sync_timer: threading.Timer | None = None
        self._unsynced = False
        self._madvise: Any = None
        self._spans: tuple[int, list[tuple[int, ...]]] | None = None
        if os.path.exists("/proc/self/maps"):
            try:
                self._madvise = ctypes.CDLL(None, use_errno=True).madvise
            except (OSError, AttributeError):
                pass
        #: why nothing can be written (None: it can): an open read-only, or the filesystem refused
        self.readonly_reason: str | None = (readonly_reason or "the store was opened read-only") if readonly else None
        try:
            self.env = self._open()
        except lmdb.Error as exc:
            if is_read_only(exc):  # nothing is damaged: the disk is read-only
                raise ReadOnlyError(f"the index at {path} is on a read-only filesystem ({exc}); remount it "
                                    "read-write, or open the store read-only") from None
            raise StoreError(f"the index at {path} cannot be opened ({type(exc).__name__}: {exc}); if it is "
                             "damaged, stop every process that uses the store and move that folder aside: the "
                             "next open rebuilds it from the segment files and the metadata journal") from None
        self._open_dbs()
        #: what ``Txn.event`` writes to (see store/events.py); the log and the index it lives
        #: in are made together, so neither is wired to the other afterwards
        self.event_log: EventLog | None = None
        if event_log_max is not None:
            from .events import EventLog  # events.py builds on this module

            self.event_log = EventLog(self, event_log_max)

    def _open_dbs(self) -> None:
        self.meta = self.env.open_db(b"meta")
        self.chunks = self.env.open_db(b"chunks")
        self.lru = self.env.open_db(b"lru")
        self.locs = self.env.open_db(b"locs")
        self.segs = self.env.open_db(b"segs")
        self.pins = self.env.open_db(b"pins")
        self.labels = self.env.open_db(b"labels")
        self.ns = self.env.open_db(b"namespaces")
        # sub-databases added after format 1: a store written before them, opened read-only,
        # has none of them; ``has_events``/``has_counts`` say so, and every reader checks
        (self.prefixes, self.events), self.has_events = self._later_dbs(b"prefixes", b"events")
        (self.keylabels, self.counts), self.has_counts = self._later_dbs(b"keylabels", b"counts")
        (self.announce,), self.has_announce = self._later_dbs(b"announce")
        (self.admission,), self.has_admission = self._later_dbs(b"admission")
        (self.aliases,), self.has_aliases = self._later_dbs(b"aliases")
        self._dbs: dict[str, Any] = {
            "meta": self.meta, "chunks": self.chunks, "lru": self.lru, "locs": self.locs, "segs": self.segs,
            "pins": self.pins, "labels": self.labels, "namespaces": self.ns, "prefixes": self.prefixes,
            "events": self.events, "keylabels": self.keylabels, "counts": self.counts,
            "announce": self.announce, "admission": self.admission, "aliases": self.aliases}
        assert tuple(self._dbs) == DB_NAMES

    def db(self, name: DbName) -> Any:
        """The handle of the sub-database ``name`` (for ``Txn``)."""
        return self._dbs[name]

    def _later_dbs(self, *names: bytes) -> tuple[list[Any], bool]:
        """Open sub-databases a writable open creates; read-only, missing ones stand in as
        ``meta`` (never read: the flag returned is False)."""
        try:
            return [self.env.open_db(n) for n in names], True
        except lmdb.Error:
            if not self.readonly:
                raise
            return [self.meta] * len(names), False

    def _open(self) -> lmdb.Environment:
        if self.readonly:
            try:
                return lmdb.open(self.path, map_size=MAP_SIZE, max_dbs=16, readahead=False, max_readers=512,
                                 readonly=True, create=False)
            except lmdb.Error:
                # a read-only filesystem: no lock file can be written, and no writer can
                # exist either, so read without LMDB's reader table
                return lmdb.open(self.path, map_size=MAP_SIZE, max_dbs=16, readahead=False, readonly=True,
                                 create=False, lock=False)
        return lmdb.open(self.path, map_size=MAP_SIZE, max_dbs=16, metasync=False, sync=True, readahead=False,
                         max_readers=512, readonly=False,
                         mode=DIR_MODE)  # the folder 0700; data.mdb and lock.mdb 0600 (x bits dropped)

    def release_pages(self) -> None:
        """Drop the index's mapped pages from this process's resident memory (they stay in
        the page cache, and the next access maps them again at the cost of a minor fault).
        A pass over every entry touches the whole map; without this the daemon would keep
        it all resident. Safe at any time: the map is read-only (LMDB writes with pwrite)."""
        if self._madvise is None or self._closed:
            return
        size = self.env.info()["map_size"]
        if self._spans is None or self._spans[0] != size:  # the map moves when it grows
            data = os.path.realpath(os.path.join(self.path, "data.mdb"))
            try:
                with open("/proc/self/maps") as f:
                    found = [line.split()[0] for line in f if line.rstrip().endswith(" " + data)]
            except OSError:
                return
            self._spans = (size, [tuple(int(x, 16) for x in span.split("-")) for span in found])
        for lo, hi in self._spans[1]:
            self._madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 4)  # MADV_DONTNEED

    def resident_file_bytes(self) -> int:
        """File-backed memory this process has resident (mostly the index's map)."""
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[2]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    def check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise StoreError("a Store object was inherited across fork(); open a new Store in the child")
        if self._closed:
            raise StoreError("the store is closed")

    @contextmanager
    def read(self) -> Iterator[Txn]:
        """A short read transaction (a snapshot; keep it open no longer than needed)."""
        self.check_usable()
        env = self.env
        try:
            txn = env.begin(write=False, buffers=False)
        except lmdb.Error as exc:
            if isinstance(exc, lmdb.PanicError):  # a commit failed half-way: the environment is dead
                self.went_read_only(f"its index could not be written ({exc})", first=True)
            elif not self._swapped(env):
                raise
            env = self.env  # opened again meanwhile
            txn = env.begin(write=False, buffers=False)
        with txn:
            try:
                yield Txn(self, txn, write=False)
            except lmdb.Error as exc:
                if not self._swapped(env):
                    raise
                raise IndexReopened(f"the index at {self.path} was opened again read-only during a read "
                                    f"({exc}); read again") from None

    def _swapped(self, env: lmdb.Environment) -> bool:
        """Whether ``env`` is no longer the index's environment (``went_read_only`` opened it
        again), once a swap in progress has finished."""
        with self._grow_lock:
            return self.env is not env

    def _grow(self) -> None:
        """Double the map once more than ``GROW_AT`` of it is in use (before a write starts)."""
        info = self.env.info()
        used = (info["last_pgno"] + 1) * self.env.stat()["psize"]
        if used > GROW_AT * info["map_size"]:
            with self._grow_lock:
                size = self.env.info()["map_size"]
                if used > GROW_AT * size:
                    self.env.set_mapsize(size * 2)
                    log.info("grew the index map of %s to %d bytes", self.path, size * 2)

    def sync(self) -> None:
        """Make every committed transaction durable (LMDB's meta page, which commits do not
        sync: see the module's docstring). One fdatasync of the index file."""
        self.check_usable()
        if self.readonly:
            return
        self._unsynced = False  # before the sync: a commit made during it sets it again
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            self._unsynced = True
            raise IndexWriteError(f"the index at {self.path} could not be synced to its disk ({exc})") from None

    def sync_soon(self) -> None:
        """Make the commits so far durable within ``SYNC_SOON_S``: a background sync, one
        for all the commits made before it runs (engine puts: no fdatasync more per batch)."""
        with self._sync_lock:
            if self._sync_timer is not None or self._closed:
                return
            timer = self._sync_timer = threading.Timer(SYNC_SOON_S, self._timed_sync)
            timer.daemon = True
        timer.start()

    def _timed_sync(self) -> None:
        with self._sync_lock:  # close() waits for a sync under way: the environment must outlive it
            self._sync_timer = None
            if self._closed or not self._unsynced:
                return
            try:
                self.sync()
            except StoreError as exc:
                log.warning("%s; the last commits are not durable yet", exc)

    @contextmanager
    def transact(self) -> Iterator[Txn]:
        """A write transaction. On commit, the segment files in ``Txn.remove`` are removed,
        once the commit is synced. On abort (any exception), what was registered with
        ``Txn.on_abort`` is undone and the exception propagates (LMDB errors as
        ``IndexWriteError``)."""
        self.check_usable()
        if self.readonly:
            raise ReadOnlyError(f"nothing can be written: {self.readonly_reason}")
        self._grow()
        t: Txn | None = None
        try:
            with self.env.begin(write=True) as txn:
                t = Txn(self, txn, write=True)
                yield t
        except BaseException as exc:
            if t is not None:
                t._aborted()
            if isinstance(exc, lmdb.MapFullError):  # one transaction larger than the room left
                with self._grow_lock:
                    self.env.set_mapsize(self.env.info()["map_size"] * 2)
                raise _MapGrown(f"the index at {self.path} was full; its map has grown") from None
            if isinstance(exc, lmdb.Error) and is_read_only(exc):
                self.went_read_only(f"its filesystem went read-only ({exc})")
                raise ReadOnlyError(f"nothing can be written: {self.readonly_reason}") from None
            if isinstance(exc, lmdb.PanicError) or (isinstance(exc, lmdb.Error) and self.readonly):
                # another thread's commit failed half-way (or it turned read-only meanwhile)
                self.went_read_only(f"its index could not be written ({exc})", first=True)
                raise ReadOnlyError(f"nothing can be written: {self.readonly_reason}") from None
            if isinstance(exc, lmdb.Error):  # e.g. the index's disk is full: nothing was committed
                raise IndexWriteError(f"the index at {self.path} could not be written ({exc}); "
                                      "is its disk full?") from None
            raise
        self._unsynced = True
        if t.remove:
            self.sync()
            self.remove_files(t.remove)

    def write(self, fn: Callable[[Txn], T], durable: bool = False) -> T:
        """Run ``fn`` in one write transaction (see ``transact``) and return its result; with
        ``durable``, the commit is synced before this returns. If the map was full, ``fn``
        runs once more in a new transaction after the map grew: what the first one did
        outside LMDB was undone by its ``on_abort`` hooks."""
        try:
            with self.transact() as t:
                out = fn(t)
        except _MapGrown:
            with self.transact() as t:
                out = fn(t)
        if durable:
            self.sync()
        return out

    def went_read_only(self, reason: str, first: bool = False) -> None:
        """The filesystem refused a write because it is read-only: from now on this index is
        read only (reads go on; every write transaction raises ``ReadOnlyError`` at once). A
        commit that failed half-way leaves LMDB's environment unusable (MDB_PANIC): it is then
        opened again, read-only. ``first``: ``reason`` replaces none given before (it is vaguer)."""
        with self._grow_lock:
            if not self.readonly:
                log.error("store index %s: %s; serving reads only from now on (saves are refused) until "
                          "the filesystem is read-write again and this process restarts", self.path, reason)
            if not (first and self.readonly):
                self.readonly_reason = reason
            self.readonly = True
            if self._closed or os.getpid() != self._pid:
                return
            try:
                with self.env.begin(write=False):
                    return  # it still reads
            except lmdb.Error:
                pass
            self.env.close()  # readers of the old one get an lmdb.Error (py-lmdb invalidates them)
            self.env = self._open()
            self._open_dbs()
            self._spans = None

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._sync_lock:
            timer, self._sync_timer = self._sync_timer, None
            if timer is not None:
                timer.cancel()
            if not self._closed and os.getpid() == self._pid:
                if self._unsynced and not self.readonly:
                    try:
                        self.sync()  # a clean close leaves nothing to a background sync
                    except StoreError as exc:
                        log.warning("%s while closing it", exc)
                self.env.close()
            self._closed = True


def drop_corrupt(index: Index, key: bytes, e: Entry, reason: str = "bad-record", detail: str = "") -> None:
    """Forget ``key`` if its entry is still ``e`` (its bytes failed verification), count it
    and log it (kind ``corrupt``, ``reason``, ``detail``: what failed)."""

    def fn(t: Txn) -> None:
        cur = t.entry(key)
        if cur is not None and (cur.seg, cur.off) == (e.seg, e.off):
            t.unindex_entry(key, cur)
            t.add("corrupt", 1)
            t.event("corrupt", reason, [key], tier=cur.tier_name, detail=detail)

    index.write(fn)


def drop_unreadable(index: Index, key: bytes, raw: bytes) -> None:
    """Forget an index entry that cannot be decoded. What it counted is recounted by
    ``Store.check(fix=True)``: its location is unknown."""

    def fn(t: Txn) -> None:
        if t.raw.get(key, db=index.chunks) == raw:
            t.raw.delete(key, db=index.chunks)
            t.forget_prefix(key)
            t.add("corrupt", 1)
            t.event("corrupt", "bad-entry", [key], detail="its index entry could not be decoded")

    index.write(fn)
