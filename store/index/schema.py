"""The index's layout: its sub-databases and every key in them, declared in one place.

Only ``store/index/__init__.py`` opens LMDB and reads or writes it (``Txn``); the other parts name a
sub-database by its name here and build their keys with the functions here, so no other
module invents a key prefix. (No imports beyond the standard library: the CLI reads the
metric and event names without opening anything.)

==========  ==========================================  =====================================
name        key                                         value
==========  ==========================================  =====================================
meta        ``META_*`` names (``config``, ...)          settings JSON, version, salt key, ...
            ``c:<name>`` (``COUNTER``)                  counter (u64 little-endian)
            ``c:ev:<kind>:<reason>`` (``EVENT_COUNTER``) the event counters (a kind of counter)
            ``m:`` + name and labels (``METRIC_CELL``)  a metric's totals (store/index/metrics.py)
            ``g:`` + name and labels (``METRIC_GAUGE``) a gauge's value and time
chunks      chunk key (48 bytes)                        ``Entry`` (packed, then layout JSON)
lru         tier id (1) + access time ns (BE u64) + key  empty
locs        segment id (BE u64) + offset (BE u64)       chunk key
segs        segment id (BE u64)                         ``SegmentRecord``
pins        chunk key                                   refs (u32), reserved bytes (u64)
labels      label + NUL + chunk key                     pin time (BE u64)
namespaces  namespace id (16 bytes)                     namespace record JSON
prefixes    ``p`` + prefix id (16) + namespace id (16)  chunk key: which namespaces hold a
            ``k`` + chunk key                           token prefix, and back (explain)
events      ``e`` + seq (BE u64)                        event JSON (store/index/events.py)
            ``k`` + chunk key                           seq (BE u64) of its latest event
            ``r`` + seq (BE u64) + chunk key            empty: the chunks an event names
keylabels   chunk key + label                           empty (the labels pinning a key)
counts      ``n`` + namespace id + tier (1)             ``Counts`` of the namespace's chunks in
                                                        the tier (packed u64s)
            ``l`` + label + NUL + namespace id + tier   ``Counts`` of the label's stored chunks
            ``k`` + label                               keys the label pins (u64), stored or not
announce    ``p`` + chain position (BE u32) + chunk key  an engine's announcement record
            ``k`` + chunk key                           its position (store/observe/announce.py)
admission   ``g`` + key fingerprint (16 bytes)          the ghost list (store/tiers/admission.py):
                                                        slot (BE u32), sightings (u8)
            ``s`` + slot (BE u32)                       the fingerprint in that slot (a ring)
            ``w`` + tier (1) + hour (BE u64)            bytes written to the tier in that hour
                                                        since the epoch (u64): the last day's
            ``t`` + tier (1)                            when the tier's writes were first
                                                        counted (double, Unix time)
==========  ==========================================  =====================================
"""

from __future__ import annotations

import struct
from typing import Literal

#: the sub-databases (``prefixes``/``events`` and ``keylabels``/``counts`` came after format 1)
DbName = Literal["meta", "chunks", "lru", "locs", "segs", "pins", "labels", "namespaces", "prefixes", "events",
                 "keylabels", "counts", "announce", "admission", "aliases"]
DB_NAMES: tuple[DbName, ...] = ("meta", "chunks", "lru", "locs", "segs", "pins", "labels", "namespaces",
                                "prefixes", "events", "keylabels", "counts", "announce", "admission", "aliases")

# -- meta ----------------------------------------------------------------------------------
META_CONFIG = b"config"  # the settings (StoreConfig JSON)
META_FORMAT = b"format_version"  # the index's format (ASCII digits)
META_SALT_KEY = b"salt_key"  # the key of salt digests and prefix ids
META_STORE_ID = b"store_id"  # this store's id (also in the folder's marker)
META_BOOT_ID = b"boot_id"  # the boot of the last writable open
META_WRITE_PROBE = b"write_probe"  # written to find out whether the index can be written
COUNTER = b"c:"
EVENT_COUNTER = COUNTER + b"ev:"
METRIC_CELL = b"m:"
METRIC_GAUGE = b"g:"

_BE64 = struct.Struct(">Q")


def counter_key(name: str) -> bytes:
    return COUNTER + name.encode()


# -- segs, locs, lru, labels, keylabels ----------------------------------------------------
def seg_key(sid: int) -> bytes:
    return _BE64.pack(sid)


def seg_id(k: bytes | memoryview) -> int:
    return int(_BE64.unpack(bytes(k[:8]))[0])


def loc_key(sid: int, off: int) -> bytes:
    return _BE64.pack(sid) + _BE64.pack(off)


def lru_key(tier: int, last_access: float, key: bytes) -> bytes:
    return bytes([tier]) + _BE64.pack(int(last_access * 1e9)) + key


def lru_chunk(k: bytes | memoryview) -> bytes:
    """The chunk key inside an ``lru`` key."""
    return bytes(k[9:])


def label_key(label: bytes, key: bytes = b"") -> bytes:
    return label + b"\0" + key


def keylabel_key(key: bytes, label: bytes = b"") -> bytes:
    return key + label


# -- aliases -------------------------------------------------------------------------------
ALIAS_ROW = b"a"
ALIAS_BACK = b"b"
_ALIAS = struct.Struct("<I")


def alias_row(alias: bytes) -> bytes:
    """An ``aliases`` row: a partial key (``keys.boundary_keys``) -> the key of the chunk whose
    record holds those tokens first, and how many tokens (``pack_alias``)."""
    return ALIAS_ROW + alias


def alias_back(key: bytes) -> bytes:
    """The ``aliases`` row that names every alias of ``key`` (their keys, one after another),
    so that the aliases go with the chunk."""
    return ALIAS_BACK + key


def pack_alias(key: bytes, tokens: int) -> bytes:
    return key + _ALIAS.pack(tokens)


def unpack_alias(raw: bytes | memoryview, key_bytes: int) -> tuple[bytes, int] | None:
    """The target key and token count of an ``aliases`` row (None: not one this code wrote)."""
    if len(raw) != key_bytes + _ALIAS.size:
        return None
    return bytes(raw[:key_bytes]), int(_ALIAS.unpack(bytes(raw[key_bytes:]))[0])


# -- prefixes ------------------------------------------------------------------------------
PREFIX_ROW = b"p"
PREFIX_BACK = b"k"


def prefix_row(prefix: bytes, key: bytes = b"") -> bytes:
    """A ``prefixes`` row: token prefix id, then the namespace id of a chunk that ends it
    (``key``'s first 16 bytes; none: the start of the prefix's rows)."""
    return PREFIX_ROW + prefix + key[:16]


def prefix_back(key: bytes) -> bytes:
    """The ``prefixes`` row that gives a chunk's prefix id back."""
    return PREFIX_BACK + key


# -- counts --------------------------------------------------------------------------------
COUNT_NS = b"n"
COUNT_LABEL = b"l"
COUNT_LABEL_KEYS = b"k"


def ns_count_key(nid: bytes, tier: int) -> bytes:
    return COUNT_NS + nid + bytes([tier])


def label_count_key(label: bytes, nid: bytes, tier: int) -> bytes:
    return COUNT_LABEL + label + b"\0" + nid + bytes([tier])


def label_keys_key(label: bytes) -> bytes:
    return COUNT_LABEL_KEYS + label


# -- events --------------------------------------------------------------------------------
EVENT_ROW = b"e"
EVENT_KEY = b"k"
EVENT_REF = b"r"


def event_row(seq: int) -> bytes:
    return EVENT_ROW + _BE64.pack(seq)


def event_seq(row: bytes | memoryview) -> int:
    """The seq of an ``event_row``."""
    return int(_BE64.unpack(bytes(row[1:9]))[0])


def event_key_row(key: bytes) -> bytes:
    return EVENT_KEY + key


def event_ref_row(seq: int, key: bytes = b"") -> bytes:
    return EVENT_REF + _BE64.pack(seq) + key


# -- announce ------------------------------------------------------------------------------
ANNOUNCE_ROW = b"p"
ANNOUNCE_KEY = b"k"
_BE32 = struct.Struct(">I")


def announce_row(pos: int | bytes, key: bytes = b"") -> bytes:
    """An ``announce`` record's row: the chain position (or its packed 4 bytes), then the key."""
    return ANNOUNCE_ROW + (pos if isinstance(pos, bytes) else _BE32.pack(pos)) + key


def announce_key_row(key: bytes) -> bytes:
    return ANNOUNCE_KEY + key


# -- admission ------------------------------------------------------------------------------
GHOST_ROW = b"g"
GHOST_SLOT = b"s"
WRITTEN_ROW = b"w"
WRITTEN_SINCE = b"t"


def ghost_row(fp: bytes) -> bytes:
    """The ghost list's row of a key fingerprint."""
    return GHOST_ROW + fp


def ghost_slot_row(slot: int) -> bytes:
    """The ghost list's ring slot ``slot``."""
    return GHOST_SLOT + _BE32.pack(slot)


def written_row(tier: int, hour: int | None = None) -> bytes:
    """The row of the bytes written to tier ``tier`` in hour ``hour`` (None: the start of the
    tier's rows)."""
    return WRITTEN_ROW + bytes([tier]) + (b"" if hour is None else _BE64.pack(hour))


def written_hour(row: bytes | memoryview) -> int:
    """The hour of a ``written_row``."""
    return int(_BE64.unpack(bytes(row[2:10]))[0])


def written_since_row(tier: int) -> bytes:
    return WRITTEN_SINCE + bytes([tier])


def key_after(row: bytes) -> bytes:
    """The least key greater than ``row`` (to go on from a page's last row)."""
    return row + b"\0"
