"""The index's records: how an entry (where a chunk's record is), a segment's record, a pin
and the counts are packed into LMDB values, and the checks that compare an entry with the
record's trailer. No LMDB here: ``txn.py`` reads and writes them."""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass
from typing import Any

from ..config import TIER_NAMES
from ..errors import CorruptEntry
from ..format.codec import CODEC_NAMES
from ..format.record import ALIGN, MAX_CHUNK_BYTES, RecordTrailer, record_len
from ..types import Origin
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

#: ``Entry.origin``: a chunk this store's engines computed, or one promoted from the remote tier
ORIGIN_LOCAL, ORIGIN_REMOTE = 0, 1


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
