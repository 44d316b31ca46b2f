"""The store: one class that owns the LMDB index, the segment tiers, eviction and pins.

Rules that keep it correct with several processes on one store:

* The index is the truth. A payload is written (and, with ``fsync``, made durable)
  before the index transaction that makes it visible commits; files are removed only
  after the transaction that forgets them commits.
* Each writing process appends only to segments it created and holds an exclusive
  ``flock`` on. Space is reserved in the index (the segment's size grows) before the
  bytes are written, so capacity is enforced across processes.
* Segment ids are never reused and indexed bytes are never overwritten, so a reader
  that raced a compaction finds either the old bytes (still valid) or no file (and
  looks the key up again). Every read checks the record's key and checksum.
* A segment whose writer died (its flock is free) is sealed by the next process that
  opens the store; bytes it reserved but never indexed are dead and compaction
  reclaims them.
"""

from __future__ import annotations

import errno
import fcntl
import functools
import json
import logging
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import lmdb

from .codec import CODEC_NAMES, Codec, codec_id
from .config import TIER_IDS, TIER_NAMES, TIER_ORDER, StoreConfig, TierConfig
from .errors import DiskFullError, PinBudgetError, StoreError
from .journal import COMPACT_BYTES as JOURNAL_COMPACT_BYTES
from .journal import MetaJournal, replay
from .keys import DTYPE_SIZES, KEY_BYTES, Namespace, NamespaceRecord
from .private import DIR_MODE, SALT_KEY_BYTES, make_private_dir, salt_digest, tighten
from .segment import (
    ALIGN,
    CorruptRecord,
    SegmentGone,
    SegmentIO,
    align_up,
    encode_header,
    record_len,
    segment_name,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")
T = TypeVar("T")

MAP_SIZE = 64 << 30
#: no chunk is this large (a 256-token chunk of a 70B model's KV is under 100 MB)
MAX_CHUNK_BYTES = 1 << 34
FORMAT_VERSION = 1

# chunks: key -> entry (+ layout JSON)
_ENTRY = struct.Struct("<QQQQQQIIBBB5xdd")  # ..., codec, tier, codec level (0: unknown), ...
_ENTRY_TIER_OFF = 57  # byte offset of the tier id inside a packed entry
# segs: seg id (BE) -> segment
_SEG = struct.Struct("<BBxxIQQQd")
SEG_OPEN, SEG_SEALED = 0, 1
# pins: key -> refs, reserved bytes (expected size while the chunk is not stored)
_PIN = struct.Struct("<IQ")
_U64 = struct.Struct("<Q")
_BE64 = struct.Struct(">Q")


@dataclass
class Entry:
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

    def pack(self) -> bytes:
        return _ENTRY.pack(self.seg, self.off, self.rec_len, self.stored_len, self.raw_len,
                           self.checksum, self.tokens, self.hits, self.codec, self.tier, self.level,
                           self.created, self.last_access) + json.dumps(
                               self.layout, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Entry:
        try:
            f = _ENTRY.unpack_from(raw, 0)
            layout = json.loads(bytes(raw[_ENTRY.size:]) or b"{}")
        except (struct.error, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            raise CorruptEntry(f"unreadable index entry: {exc}") from None
        if f[9] not in TIER_NAMES or f[8] not in CODEC_NAMES or not isinstance(layout, dict):
            raise CorruptEntry(f"index entry names tier {f[9]} and codec {f[8]}")
        if not (0 <= f[11] < 1.8e10 and 0 <= f[12] < 1.8e10):  # NaN fails too
            raise CorruptEntry("index entry has impossible times")
        if max(f[2], f[3], f[4]) >= MAX_CHUNK_BYTES or f[1] % ALIGN or f[2] % ALIGN:
            raise CorruptEntry("index entry has impossible lengths or offsets")
        return cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9], f[11], f[12], layout, f[10])

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


@dataclass
class Segment:
    tier: int
    state: int
    pid: int
    size: int
    live_bytes: int
    live_count: int
    created: float

    def pack(self) -> bytes:
        return _SEG.pack(self.tier, self.state, self.pid, self.size, self.live_bytes,
                         self.live_count, self.created)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> Segment:
        return cls(*_SEG.unpack(raw))


@dataclass
class Chunk:
    """A chunk read from the store. ``data`` is the decoded payload."""

    key: bytes
    data: Buffer
    layout: dict[str, Any]
    tokens: int
    tier: str
    codec: str


@dataclass
class ChunkInfo:
    """Index metadata of one chunk (no payload)."""

    key: bytes
    tier: str
    codec: str
    stored_bytes: int
    raw_bytes: int
    disk_bytes: int
    tokens: int
    hits: int
    created: float
    last_access: float
    pin_refs: int
    layout: dict[str, Any]
    segment: int
    offset: int
    level: int = 0


def trailer_mismatch(key: bytes, e: Entry, hdr: Any) -> str | None:
    """What an index entry and its record's checksummed trailer disagree on, if anything.
    LMDB keeps no checksums of its own, so every read checks the entry against the trailer."""
    layout = hdr.meta.get("layout", {}) if isinstance(hdr.meta, dict) else None
    tokens = hdr.meta.get("tokens", 0) if isinstance(hdr.meta, dict) else None
    if e.rec_len != record_len(e.stored_len):
        return "the record length"
    for what, ours, theirs in (("the key", key, hdr.key), ("the checksum", e.checksum, hdr.checksum),
                               ("the codec", e.codec, hdr.codec), ("the stored length", e.stored_len, hdr.stored_len),
                               ("the raw length", e.raw_len, hdr.raw_len), ("the layout", e.layout, layout),
                               ("the token count", e.tokens, tokens)):
        if ours != theirs:
            return what
    return None


def short_key(key: bytes) -> str:
    """What tells two chunks apart in a message: the start of the chunk hash (a key's first
    16 bytes are its namespace, the same for every chunk of a model and adapter)."""
    return key[16:24].hex() if len(key) > 16 else key.hex()


@dataclass
class PutItem:
    key: bytes
    data: Buffer
    layout: dict[str, Any]
    tokens: int = 0
    codec: str | None = None


@dataclass
class LookupResult:
    total_tokens: int
    hit_tokens: int
    chunk_size: int
    keys: list[bytes]
    tiers: list[str | None]

    @property
    def hit_chunks(self) -> int:
        return self.hit_tokens // self.chunk_size if self.chunk_size else 0


@dataclass
class Problem:
    """One inconsistency found by ``Store.check``."""

    kind: str
    detail: str
    fixed: bool = False


class IndexWriteError(StoreError):
    """A write transaction of the index failed (nothing of it was committed)."""


class CorruptEntry(StoreError):
    """An index entry that cannot be decoded (LMDB keeps no checksums of its own)."""


class _RolledBack(Exception):
    """Raised inside a write transaction to abort it (a dry run) and carry its result out."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


class EvictionPolicy(Protocol):
    """Chooses which chunks of a tier go first. It must never yield a pinned chunk."""

    name: str

    def victims(self, store: Store, txn: lmdb.Transaction, tier: int) -> Iterator[bytes]: ...


class LRUPolicy:
    """Least recently used first (access times are flushed to the index in batches)."""

    name = "lru"

    def victims(self, store: Store, txn: lmdb.Transaction, tier: int) -> Iterator[bytes]:
        cur = txn.cursor(db=store._db_lru)
        prefix = bytes([tier])
        if not cur.set_range(prefix):
            return
        pins = txn.cursor(db=store._db_pins)
        for k in cur.iternext(values=False):
            if k[:1] != prefix:
                return
            key = bytes(k[9:])
            if pins.set_key(key) and _PIN.unpack(pins.value())[0] > 0:
                continue
            yield key


@dataclass
class _TierState:
    name: str
    tid: int
    cfg: TierConfig
    io: SegmentIO
    open_seg: int | None = None
    open_fd: int | None = None
    retired_fds: list[int] = field(default_factory=list)


class Store:
    """A KV chunk store on local disk. Thread-safe; open one per process."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: StoreConfig | None = None,
        *,
        policy: EvictionPolicy | None = None,
        readonly: bool = False,
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.readonly = readonly
        self.policy: EvictionPolicy = policy or LRUPolicy()
        self._lock = threading.RLock()
        self._pid = os.getpid()
        self._access: dict[bytes, tuple[float, int]] = {}
        self._stats_mem = {"hits": 0, "misses": 0}
        self._last_flush = time.monotonic()
        self._closed = False
        if readonly and not os.path.isdir(os.path.join(self.path, "index")):
            raise StoreError(f"no store at {self.path}; create it first (open it without readonly)")
        if not readonly:
            # private whatever the umask: the folder 0700, its files 0600 (SPEC section 2)
            make_private_dir(self.path)
            make_private_dir(os.path.join(self.path, "index"))
        self._open_env()
        self._journal = None if readonly else MetaJournal(os.path.join(self.path, "meta.journal"))
        # an index that is new while a journal exists: the index was lost; its settings,
        # salt key, namespaces and pins come back from the journal, its chunks from the segments
        restore = None
        if self._journal is not None and self._index_is_new() and self._journal.size():
            restore = replay(self._journal.records())
            if config is None and restore["config"]:
                config = StoreConfig.from_json(restore["config"])
        self.config = self._load_config(config)
        self._salt_key = self._load_salt_key(None if restore is None else restore["salt_key"])
        self.codec = Codec(self.config.codec_level)
        self._tiers: dict[str, _TierState] = {}
        for name in TIER_ORDER:
            if name in self.config.tiers:
                cfg = self.config.tiers[name]
                d = cfg.path or os.path.join(self.path, name)
                self._tiers[name] = _TierState(name, TIER_IDS[name], cfg, SegmentIO(d, readonly=readonly))
        if not readonly:
            fixed = tighten(self.path, [st.io.dir for st in self._tiers.values()])
            if fixed:
                log.warning("made %d files and folders of store %s private (0700 folders, 0600 files); "
                            "they were open to other users: %s", len(fixed), self.path,
                            ", ".join(f"{os.path.relpath(p, self.path)} ({m:04o})" for p, m in fixed[:6])
                            + (", ..." if len(fixed) > 6 else ""))
            self.recover()
            if restore is not None or (self._index_is_empty() and self._segment_files()):
                self._restore(restore)
            for name in self._tiers:
                self._enforce_capacity(name, 0)

    # -- environment -------------------------------------------------------------
    def _open_env(self) -> None:
        try:
            self._open_lmdb()
        except lmdb.Error as exc:
            index = os.path.join(self.path, "index")
            raise StoreError(f"the index at {index} cannot be opened ({type(exc).__name__}: {exc}); if it is "
                             "damaged, stop every process that uses the store and move that folder aside: the "
                             "next open rebuilds it from the segment files and the metadata journal") from None

    def _open_lmdb(self) -> None:
        index = os.path.join(self.path, "index")
        if self.readonly:
            try:
                self._env = lmdb.open(index, map_size=MAP_SIZE, max_dbs=16, readahead=False, max_readers=512,
                                      readonly=True, create=False)
            except lmdb.Error:
                # a read-only filesystem: no lock file can be written, and no writer can
                # exist either, so read without LMDB's reader table
                self._env = lmdb.open(index, map_size=MAP_SIZE, max_dbs=16, readahead=False, readonly=True,
                                      create=False, lock=False)
        else:
            self._env = lmdb.open(
                index, map_size=MAP_SIZE, max_dbs=16, metasync=False,
                sync=True, readahead=False, max_readers=512, readonly=False,
                mode=DIR_MODE,  # the index folder 0700; data.mdb and lock.mdb 0600 (x bits dropped)
            )
        self._db_meta = self._env.open_db(b"meta")
        self._db_chunks = self._env.open_db(b"chunks")
        self._db_lru = self._env.open_db(b"lru")
        self._db_locs = self._env.open_db(b"locs")
        self._db_segs = self._env.open_db(b"segs")
        self._db_pins = self._env.open_db(b"pins")
        self._db_labels = self._env.open_db(b"labels")
        self._db_ns = self._env.open_db(b"namespaces")

    def _check_fork(self) -> None:
        if os.getpid() != self._pid:
            raise StoreError("a Store object was inherited across fork(); open a new Store in the child")
        if self._closed:
            raise StoreError("the store is closed")

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a write transaction, growing the map once if LMDB says it is full."""
        self._check_fork()
        if self.readonly:
            raise StoreError("this store was opened read-only")
        for attempt in range(2):
            try:
                with self._env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                if attempt:
                    raise
                self._env.set_mapsize(self._env.info()["map_size"] * 2)
            except lmdb.Error as exc:  # e.g. the index's disk is full: nothing was committed
                raise IndexWriteError(f"the index at {os.path.join(self.path, 'index')} could not be written "
                                      f"({exc}); is its disk full?") from None
        raise AssertionError("unreachable")

    def _read(self) -> lmdb.Transaction:
        self._check_fork()
        return self._env.begin(write=False, buffers=False)

    def _load_config(self, config: StoreConfig | None) -> StoreConfig:
        def load(txn: lmdb.Transaction) -> tuple[StoreConfig, bool]:
            """The settings, and whether they were written now (given, or a new index)."""
            raw = txn.get(b"config", db=self._db_meta)
            ver = txn.get(b"format_version", db=self._db_meta)
            if ver is not None and int(ver) != FORMAT_VERSION:
                raise StoreError(f"store format {int(ver)} is not supported by this lmctl ({FORMAT_VERSION})")
            if config is None and raw is not None:
                return StoreConfig.from_json(bytes(raw)), False
            cfg = config or StoreConfig()
            cfg.validate()
            txn.put(b"config", cfg.to_json().encode(), db=self._db_meta)
            txn.put(b"format_version", str(FORMAT_VERSION).encode(), db=self._db_meta)
            return cfg, True

        if self.readonly:
            with self._read() as txn:
                raw = txn.get(b"config", db=self._db_meta)
                return StoreConfig.from_json(bytes(raw)) if raw else StoreConfig()
        cfg, written = self._write(load)
        if written:
            self._journal_add("config", config=cfg.to_json())
        return cfg

    def configure(self, config: StoreConfig) -> None:
        """Replace the store's settings (capacity, budgets, codec) and apply them now."""
        config.validate()
        for name, st in self._tiers.items():
            if name not in config.tiers:
                raise StoreError(f"tier {name} cannot be removed from a store's settings (it may hold chunks); "
                                 f"evict its chunks and keep it, or give it a small capacity")
            new_dir = config.tiers[name].path or os.path.join(self.path, name)
            if os.path.abspath(new_dir) != os.path.abspath(st.io.dir):
                raise StoreError(f"tier {name}'s folder cannot change while the store uses it ({st.io.dir}); "
                                 "stop every process that uses the store and move the folder first")
        with self._lock:
            self._write(lambda txn: txn.put(b"config", config.to_json().encode(), db=self._db_meta))
            self._journal_add("config", config=config.to_json())
            self.config = config
            self.codec = Codec(config.codec_level)
            for name in TIER_ORDER:
                if name in config.tiers and name not in self._tiers:
                    cfg = config.tiers[name]
                    d = cfg.path or os.path.join(self.path, name)
                    self._tiers[name] = _TierState(name, TIER_IDS[name], cfg, SegmentIO(d))
            for name, st in self._tiers.items():
                st.cfg = config.tiers[name]
                self._enforce_capacity(name, 0)

    @staticmethod
    def _must(raw: bytes | memoryview | None) -> bytes | memoryview:
        if raw is None:
            raise StoreError("index is inconsistent (a segment record is missing); run lmctl verify --fix")
        return raw

    # -- counters ----------------------------------------------------------------
    def _add(self, txn: lmdb.Transaction, name: str, delta: int) -> int:
        k = b"c:" + name.encode()
        raw = txn.get(k, db=self._db_meta)
        v = (_U64.unpack(raw)[0] if raw else 0) + delta
        if v < 0:
            log.warning("counter %s went negative (%d); clamping, run verify to recount", name, v)
            v = 0
        txn.put(k, _U64.pack(v), db=self._db_meta)
        return v

    def _get_counter(self, txn: lmdb.Transaction, name: str) -> int:
        raw = txn.get(b"c:" + name.encode(), db=self._db_meta)
        return _U64.unpack(raw)[0] if raw else 0

    # -- namespaces --------------------------------------------------------------
    # -- the metadata journal (store/journal.py) ------------------------------------
    def _index_is_new(self) -> bool:
        with self._read() as txn:
            return txn.get(b"config", db=self._db_meta) is None

    def _index_is_empty(self) -> bool:
        with self._read() as txn:
            return txn.stat(self._db_chunks)["entries"] == 0 and txn.stat(self._db_segs)["entries"] == 0

    def _segment_files(self) -> bool:
        return any(st.io.segment_ids() for st in self._tiers.values())

    def _journal_add(self, op: str, **fields: Any) -> None:
        if self._journal is None:
            return
        try:
            self._journal.append(op, **fields)
        except OSError as exc:  # the index holds the change; only a later rebuild would miss it
            log.warning("could not add to the metadata journal %s: %s", self._journal.path, exc)

    def _restore(self, state: dict[str, Any] | None) -> None:
        """After the index was lost: chunks from the segments, then what the journal kept."""
        if state is not None and state["dropped"]:
            # segments the lost index had already dropped (their chunks evicted or moved): a
            # kill before their unlink left them; they are not taken back
            for st in self._tiers.values():
                for sid in st.io.segment_ids():
                    if sid in state["dropped"]:
                        os.unlink(st.io.path(sid))
        found = self.rebuild_index() if self._segment_files() else 0
        if state is not None and state["dropped"]:
            top = max(state["dropped"])

            def issued(txn: lmdb.Transaction) -> None:  # segment ids are never issued twice
                if self._get_counter(txn, "next_segment") < top:
                    txn.put(b"c:next_segment", _U64.pack(top), db=self._db_meta)

            self._write(issued)
        if state is None:
            log.warning("store %s: the index was missing; rebuilt %d chunk(s) from the segment files. No "
                        "metadata journal: pins, labels, namespace records and settings could not be restored",
                        self.path, found)
            return

        def fn(txn: lmdb.Transaction) -> None:
            for nid, doc in state["namespaces"].items():
                txn.put(bytes.fromhex(nid), json.dumps(doc, sort_keys=True).encode(), db=self._db_ns)

        self._write(fn)
        pinned = failed = 0
        for label, entry in state["labels"].items():
            keys = [bytes.fromhex(k) for k in entry["keys"]]
            try:
                pinned += self.pin(label, keys, expected_bytes=int(entry.get("expected", 0)), journal=False)
            except StoreError as exc:
                failed += 1
                log.warning("could not restore the pins of label %r: %s", label, exc)
        log.warning("store %s: the index was missing; rebuilt %d chunk(s) from the segment files and restored "
                    "from the metadata journal: the settings, %d namespace record(s), %d label(s) with %d pin(s)%s",
                    self.path, found, len(state["namespaces"]), len(state["labels"]) - failed, pinned,
                    f"; {failed} label(s) could not be pinned again" if failed else "")

    def _journal_snapshot(self) -> list[bytes]:
        recs = [MetaJournal.encode("config", config=self.config.to_json())]
        if self._salt_key is not None:
            recs.append(MetaJournal.encode("salt_key", key=self._salt_key.hex()))
        with self._read() as txn:
            for k, v in txn.cursor(db=self._db_ns):
                recs.append(MetaJournal.encode("ns", id=bytes(k).hex(), doc=json.loads(bytes(v))))
            labels: dict[str, list[str]] = {}
            for k in txn.cursor(db=self._db_labels).iternext(values=False):
                lb, _, key = bytes(k).partition(b"\0")
                labels.setdefault(lb.decode(), []).append(key.hex())
        for name, hexkeys in labels.items():
            recs.append(MetaJournal.encode("pin", label=name, keys=hexkeys))
        return recs

    def compact_journal(self, force: bool = False) -> bool:
        """Rewrite the journal as a snapshot of the index once it has grown large."""
        if self._journal is None or (not force and self._journal.size() < JOURNAL_COMPACT_BYTES):
            return False
        self._journal.replace(self._journal_snapshot)
        return True

    def _load_salt_key(self, restored: str | None = None) -> bytes | None:
        """The store's secret key for salt digests, made once (in the index, 0600) when the
        store is first opened for writing. Namespace records written before salts were kept
        as digests hold the salt itself: they are rewritten here, once."""
        if self.readonly:
            with self._read() as txn:
                raw = txn.get(b"salt_key", db=self._db_meta)
                return None if raw is None else bytes(raw)

        made: list[bytes] = []

        def fn(txn: lmdb.Transaction) -> tuple[bytes, int]:
            raw = txn.get(b"salt_key", db=self._db_meta)
            if raw is not None:
                key = bytes(raw)
            else:
                key = bytes.fromhex(restored) if restored else os.urandom(SALT_KEY_BYTES)
                txn.put(b"salt_key", key, db=self._db_meta)
                made.append(key)
            legacy = []
            for k, v in txn.cursor(db=self._db_ns):
                doc = json.loads(bytes(v))
                if "cache_salt" in doc.get("namespace", {}):
                    legacy.append((bytes(k), doc))
            for k, doc in legacy:
                salt = doc["namespace"].pop("cache_salt")
                doc["namespace"]["salt_digest"] = None if salt is None else salt_digest(key, salt)
                txn.put(k, json.dumps(doc, sort_keys=True).encode(), db=self._db_ns)
            return key, len(legacy)

        key, migrated = self._write(fn)
        if made:
            self._journal_add("salt_key", key=key.hex())
        if migrated:
            log.warning("rewrote %d namespace records of store %s to keep keyed digests of cache salts "
                        "instead of the salts", migrated, self.path)
        return key

    def salt_digest(self, cache_salt: str | None) -> str | None:
        """The keyed digest that namespace records keep instead of ``cache_salt`` (None: unsalted)."""
        if cache_salt is None:
            return None
        if self._salt_key is None:
            raise StoreError(f"store {self.path} has no salt key yet; open it for writing once")
        return salt_digest(self._salt_key, cache_salt)

    def register_namespace(self, ns: Namespace, info: dict[str, Any] | None = None) -> bytes:
        """Record a namespace (and optional facts such as the tokenizer source) for operators.
        The record keeps a keyed digest of the cache salt, never the salt."""
        doc: dict[str, Any] = {"namespace": ns.record(self.salt_digest(ns.cache_salt)), "info": info or {},
               "updated": time.time()}

        def fn(txn: lmdb.Transaction) -> bool:
            old = txn.get(ns.ns_id, db=self._db_ns)
            changed = old is None
            if old is not None:
                prev = json.loads(bytes(old))
                same = prev.get("info") == doc["info"] and prev.get("namespace") == doc["namespace"]
                # "updated" is also when an engine last used the namespace (engines record
                # theirs every few minutes): eviction retires fingerprints nobody uses
                if same and doc["updated"] - float(prev.get("updated", 0)) < 60:
                    return False
                doc["info"] = {**prev.get("info", {}), **doc["info"]}
                changed = doc["info"] != prev.get("info") or doc["namespace"] != prev.get("namespace")
            txn.put(ns.ns_id, json.dumps(doc, sort_keys=True).encode(), db=self._db_ns)
            return changed

        if self._write(fn):
            self._journal_add("ns", id=ns.ns_id.hex(), doc=doc)
        return ns.ns_id

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """Namespace records by ns_id: ``{"namespace": {model, kv_format, adapter,
        model_fingerprint, salt_digest}, "info": {...}, "updated": time}``."""
        with self._read() as txn:
            return {bytes(k): json.loads(bytes(v)) for k, v in txn.cursor(db=self._db_ns)}

    def namespace_records(self) -> dict[bytes, tuple[NamespaceRecord, dict[str, Any]]]:
        """Each recorded namespace parsed, with its raw record; unreadable records are skipped."""
        out = {}
        for nid, doc in self.namespaces().items():
            try:
                out[nid] = (NamespaceRecord.from_record(nid, doc["namespace"]), doc)
            except (KeyError, TypeError, ValueError, StoreError):
                continue
        return out

    def retired_namespaces(self, txn: lmdb.Transaction | None = None) -> set[bytes]:
        """Namespaces of a model fingerprint that has been superseded: an engine has served
        the same model id with another fingerprint (a new checkpoint) since, and none has
        used this one for ``retire_after_s``. Their chunks can never be hit again by the
        current checkpoint, so eviction takes them first."""
        if txn is None:
            with self._read() as rtxn:
                return self.retired_namespaces(rtxn)
        last: dict[tuple[str, str | None], float] = {}
        owners: dict[tuple[str, str | None], list[bytes]] = {}
        for k, v in txn.cursor(db=self._db_ns):
            try:
                doc = json.loads(bytes(v))
                nsd = doc.get("namespace", {})
                ident = (str(nsd["model"]), nsd.get("model_fingerprint"))
                t = float(doc.get("updated", 0))
            except (ValueError, KeyError, TypeError):
                continue
            last[ident] = max(last.get(ident, 0.0), t)
            owners.setdefault(ident, []).append(bytes(k))
        current: dict[str, tuple[float, str | None]] = {}
        for (model, fp), t in last.items():
            if model not in current or t > current[model][0]:
                current[model] = (t, fp)
        cutoff = time.time() - self.config.retire_after_s
        return {nid for (model, fp), t in last.items() if fp != current[model][1] and t < cutoff
                for nid in owners[(model, fp)]}

    # -- writing -----------------------------------------------------------------
    def put(self, key: bytes, data: Buffer, layout: dict[str, Any], tokens: int = 0,
            codec: str | None = None) -> bool:
        """Store one chunk; see ``put_many``."""
        return self.put_many([PutItem(key, data, layout, tokens, codec)])[0]

    def put_many(self, items: Sequence[PutItem], tier: str | None = None, *, level: int | None = None,
                 _replace: dict[bytes, Entry] | None = None) -> list[bool]:
        """Store chunks in one batch: one reservation, sequential writes, one sync, one commit.

        Returns, per item, whether it was stored. A chunk that is already present is
        not written again; a chunk that does not fit (the tier is full of pinned
        chunks, or the chunk is larger than the tier) is dropped and counted, never
        raised: a cache that cannot store simply misses later.
        """
        tier_name = tier or self.config.default_tier
        st = self._tier(tier_name)
        prepared = []
        for it in items:
            if len(it.key) != KEY_BYTES:
                raise StoreError(f"chunk key must be {KEY_BYTES} bytes, got {len(it.key)}")
            layout = dict(it.layout)
            dtype = layout.get("dtype", "uint8")
            itemsize = DTYPE_SIZES.get(dtype, 1)
            cid = codec_id(it.codec or self.config.codec)
            raw = memoryview(it.data).cast("B")
            stored = self.codec.encode(cid, raw, itemsize, level)
            now = time.time()
            rec_len = record_len(len(memoryview(stored)))
            prepared.append((it, layout, cid, raw, stored, rec_len, now))

        with self._lock:
            try:
                plan = self._reserve(st, [(p[0].key, p[5]) for p in prepared], replacing=set(_replace or ()))
            except OSError as exc:  # a new segment file could not be made
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(f"the disk under tier {st.name} ({st.io.dir}) is full: no room for a new "
                                        "segment file; free space there or lower the tier's capacity") from None
                raise
            written = 0
            results = [False] * len(prepared)
            todo = []
            pending = []
            failure: BaseException | None = None
            try:
                for i, p in enumerate(prepared):
                    slot = plan[i]
                    if slot is None:
                        continue
                    seg, off, fd = slot
                    it, layout, cid, raw, stored, _rec_len, now = p
                    meta = {"layout": layout, "tokens": it.tokens}
                    # hashing this record overlaps the disk write of the previous one
                    pw = st.io.start_write(fd, off, stored, functools.partial(
                        encode_header, it.key, cid, meta, len(memoryview(stored)), len(raw), created=now))
                    pending.append(pw)
                    todo.append((i, p, seg, off, pw))
            except BaseException as exc:
                failure = exc
            for pw in pending:  # every write is waited for (its buffers must outlive it)
                try:
                    written += pw.result()[0]
                except BaseException as exc:
                    failure = failure or exc
            done = [(i, p, seg, off, pw.checksum) for i, p, seg, off, pw in todo]
            if failure is None and done and self.config.fsync:
                try:
                    for fd in {s[2] for s in plan if s is not None}:
                        st.io.sync(fd)
                except OSError as exc:
                    failure = exc
            if failure is not None:
                # nothing of this batch is indexed: give its reserved space back, so a full
                # disk never leaves phantom usage behind that would evict real chunks
                self._release(st, plan)
                self._close_retired(st)
                if isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(
                        f"the disk under tier {st.name} ({st.io.dir}) is full: {len(done) or len(todo)} chunk(s) "
                        "not stored; free space there or lower the tier's capacity") from None
                raise failure
            if not done:
                self._close_retired(st)
                return results
            self._close_retired(st)

            unlink: list[tuple[str, int]] = []

            def commit(txn: lmdb.Transaction) -> None:
                payload = 0
                for i, p, seg, off, csum in done:
                    it, layout, cid, raw, stored, rec_len, now = p
                    created, last, hits = now, now, 0
                    cur = txn.get(it.key, db=self._db_chunks)
                    if cur is not None:
                        old = (_replace or {}).get(it.key)
                        e_cur = Entry.unpack(cur)
                        if old is None or (e_cur.seg, e_cur.off, e_cur.tier) != (old.seg, old.off, old.tier):
                            continue  # stored (or changed) meanwhile by another process; ours is dead space
                        self._unindex_entry(txn, it.key, e_cur, unlink)
                        created, last, hits = e_cur.created, e_cur.last_access, e_cur.hits
                    e = Entry(seg, off, rec_len, len(memoryview(stored)), len(raw), csum,
                              it.tokens, hits, cid, st.tid, created, last, layout,
                              0 if cid == 0 else (self.codec.level if level is None else level))
                    self._index_entry(txn, it.key, e)
                    results[i] = True
                    payload += e.stored_len
                self._add(txn, "written_bytes", written)
                self._add(txn, "payload_bytes", payload)
                self._add(txn, "puts", sum(results))

            try:
                self._write(commit)
            except StoreError:
                self._release(st, plan)  # not indexed: give its space back (if the index can be written)
                raise
            self._unlink(unlink)
            return results

    def rewrite(self, keys: Sequence[bytes], tier: str | None = None, codec: str | None = None,
                level: int | None = None, progress: Callable[[int, int], None] | None = None,
                dry_run: bool = False) -> dict[str, int]:
        """Move chunks to ``tier`` and/or re-encode them with ``codec`` (at ``level``).

        Each chunk is read (and verified), written anew, and its index entry switched in
        one transaction; pins, hit counts and access times carry over. Chunks already in
        that tier with that codec are left alone. Returns counts: ``chunks`` rewritten,
        ``bytes_before`` and ``bytes_after`` (stored bytes), ``skipped``, ``missing``.
        """
        if tier is not None:
            self._tier(tier)
        want_codec = None if codec is None else codec_id(codec)
        out = {"chunks": 0, "bytes_before": 0, "bytes_after": 0, "skipped": 0, "missing": 0}
        total = len(keys)
        todo: list[tuple[bytes, Entry, int]] | None = [] if dry_run else None
        for n, key in enumerate(keys):
            if progress is not None:
                progress(n, total)
            out[self._rewrite_one(key, tier, want_codec, level, dry_run, out, todo)] += 1
        if todo is not None:
            out["bytes_after"] = self._estimate(todo, level)
        if progress is not None:
            progress(total, total)
        return out

    def _estimate(self, todo: list[tuple[bytes, Entry, int]], level: int | None, samples: int = 8) -> int:
        """Stored bytes after re-encoding ``todo``, estimated from up to ``samples`` chunks
        spread over it (each read, verified and encoded; nothing is written)."""
        if not todo:
            return 0
        step = max(1, len(todo) // samples)
        before = after = 0
        for key, e, dst_codec in todo[::step][:samples]:
            chunk = self.get(key, touch=False)
            if chunk is None:
                continue
            itemsize = DTYPE_SIZES.get(chunk.layout.get("dtype", "uint8"), 1)
            data = memoryview(chunk.data).cast("B")
            before += e.stored_len
            after += len(memoryview(self.codec.encode(dst_codec, data, itemsize, level)))
        total_before = sum(e.stored_len for _k, e, _c in todo)
        return round(total_before * after / before) if before else total_before

    def _rewrite_one(self, key: bytes, tier: str | None, want_codec: int | None, level: int | None,
                     dry_run: bool, out: dict[str, int], estimate: list[tuple[bytes, Entry, int]] | None) -> str:
        for _attempt in range(5):  # compaction may relocate the chunk under us: try again
            with self._read() as txn:
                raw = txn.get(key, db=self._db_chunks)
            if raw is None:
                return "missing"
            e = Entry.unpack(raw)
            dst_tier = tier or e.tier_name
            dst_codec = e.codec if want_codec is None else want_codec
            same_level = level is None or dst_codec == 0 or e.level == level
            if dst_tier == e.tier_name and dst_codec == e.codec and same_level:
                return "skipped"
            if dry_run:
                out["bytes_before"] += e.stored_len
                if estimate is not None:
                    estimate.append((key, e, dst_codec))
                return "chunks"
            chunk = self.get(key, touch=False)
            if chunk is None:
                return "missing"
            item = PutItem(key, chunk.data, chunk.layout, chunk.tokens, CODEC_NAMES[dst_codec])
            if self.put_many([item], dst_tier, level=level, _replace={key: e})[0]:
                new = self.info(key)
                out["bytes_before"] += e.stored_len
                out["bytes_after"] += new.stored_bytes if new else 0
                return "chunks"
        return "skipped"

    def _index_entry(self, txn: lmdb.Transaction, key: bytes, e: Entry) -> None:
        txn.put(key, e.pack(), db=self._db_chunks)
        txn.put(bytes([e.tier]) + _BE64.pack(int(e.last_access * 1e9)) + key, b"", db=self._db_lru)
        txn.put(_BE64.pack(e.seg) + _BE64.pack(e.off), key, db=self._db_locs)
        seg = Segment.unpack(self._must(txn.get(_BE64.pack(e.seg), db=self._db_segs)))
        seg.live_bytes += e.rec_len
        seg.live_count += 1
        txn.put(_BE64.pack(e.seg), seg.pack(), db=self._db_segs)
        tname = TIER_NAMES[e.tier]
        self._add(txn, f"live:{tname}", e.rec_len)
        self._add(txn, f"count:{tname}", 1)
        pin = txn.get(key, db=self._db_pins)
        if pin is not None:
            refs, reserved = _PIN.unpack(pin)
            if refs:
                self._add(txn, f"pinned:{tname}", e.rec_len)
                self._add(txn, "pin_reserved", -reserved)
                txn.put(key, _PIN.pack(refs, 0), db=self._db_pins)

    def _unindex_entry(self, txn: lmdb.Transaction, key: bytes, e: Entry, unlink: list[tuple[str, int]]) -> None:
        txn.delete(key, db=self._db_chunks)
        txn.delete(bytes([e.tier]) + _BE64.pack(int(e.last_access * 1e9)) + key, db=self._db_lru)
        txn.delete(_BE64.pack(e.seg) + _BE64.pack(e.off), db=self._db_locs)
        tname = TIER_NAMES[e.tier]
        self._add(txn, f"live:{tname}", -e.rec_len)
        self._add(txn, f"count:{tname}", -1)
        pin = txn.get(key, db=self._db_pins)
        if pin is not None:
            refs, _ = _PIN.unpack(pin)
            if refs:
                self._add(txn, f"pinned:{tname}", -e.rec_len)
                self._add(txn, "pin_reserved", e.rec_len)
                txn.put(key, _PIN.pack(refs, e.rec_len), db=self._db_pins)
        raw = txn.get(_BE64.pack(e.seg), db=self._db_segs)
        if raw is None:
            return
        seg = Segment.unpack(raw)
        # clamped: an index entry damaged on disk may overstate what it counted (recount fixes it)
        seg.live_bytes = max(0, seg.live_bytes - e.rec_len)
        seg.live_count = max(0, seg.live_count - 1)
        if seg.live_count <= 0 and seg.state == SEG_SEALED:
            txn.delete(_BE64.pack(e.seg), db=self._db_segs)
            self._add(txn, f"used:{tname}", -seg.size)
            unlink.append((tname, e.seg))
        else:
            txn.put(_BE64.pack(e.seg), seg.pack(), db=self._db_segs)

    def _unlink(self, unlink: list[tuple[str, int]]) -> None:
        if unlink:
            # a rebuild after a lost index must not take these back, should a kill leave one
            self._journal_add("drop_segments", ids=sorted({sid for _t, sid in unlink}))
        for tname, seg_id in unlink:
            st = self._tiers[tname]
            st.io.forget(seg_id)
            if st.open_seg == seg_id:
                continue
            try:
                os.unlink(st.io.path(seg_id))
            except FileNotFoundError:
                pass

    def _release(self, st: _TierState, plan: list[tuple[int, int, int] | None]) -> None:
        """Give back the space a failed batch reserved: each segment it wrote to is cut back to
        where the batch began in it (this process appends alone to its segments, under
        ``self._lock``, so that region is the tail)."""
        start: dict[int, tuple[int, int]] = {}
        for slot in plan:
            if slot is not None:
                seg, off, fd = slot
                if seg not in start or off < start[seg][0]:
                    start[seg] = (off, fd)

        def fn(txn: lmdb.Transaction) -> None:
            for seg, (off, _fd) in start.items():
                raw = txn.get(_BE64.pack(seg), db=self._db_segs)
                if raw is None:
                    continue
                s = Segment.unpack(raw)
                if s.size > off:
                    self._add(txn, f"used:{st.name}", off - s.size)
                    s.size = off
                    txn.put(_BE64.pack(seg), s.pack(), db=self._db_segs)

        try:
            self._write(fn)
        except StoreError as exc:  # the index's own disk is full too: recovery recounts
            log.warning("could not give back the space of a failed write: %s", exc)
        for _seg, (off, fd) in start.items():
            try:
                os.ftruncate(fd, off)
            except OSError:
                pass

    def _tier(self, name: str) -> _TierState:
        try:
            return self._tiers[name]
        except KeyError:
            raise StoreError(
                f"tier {name!r} is not configured in this store (configured: {', '.join(self._tiers)})"
            ) from None

    def _reserve(self, st: _TierState, needs: list[tuple[bytes, int]],
                 replacing: set[bytes] | None = None) -> list[tuple[int, int, int] | None]:
        """Reserve space for records in this process's open segment, evicting if needed."""
        total = sum(n for _, n in needs)
        self._enforce_capacity(st.name, total)
        created: list[int] = []

        def fn(txn: lmdb.Transaction) -> list[tuple[int, int, int] | None]:
            out: list[tuple[int, int, int] | None] = []
            cap = st.cfg.capacity
            used = self._get_counter(txn, f"used:{st.name}")
            for key, n in needs:
                present = key not in (replacing or ()) and txn.get(key, db=self._db_chunks) is not None
                if present or n + ALIGN > cap:
                    out.append(None)
                    if n + ALIGN > cap:
                        self._add(txn, "rejected_full", 1)
                    continue
                if used + n > cap:
                    out.append(None)
                    self._add(txn, "rejected_full", 1)
                    continue
                out.append(self._alloc(txn, st, n, created))
                used += n
            return out

        try:
            return self._write(fn)
        except BaseException:
            # segments created in an aborted transaction are not registered: remove them
            for seg_id in created:
                if st.open_seg == seg_id:
                    self._drop_open(st)
                try:
                    os.unlink(st.io.path(seg_id))
                except FileNotFoundError:
                    pass
            raise

    def _alloc(self, txn: lmdb.Transaction, st: _TierState, n: int, created: list[int]) -> tuple[int, int, int]:
        """Grow this process's open segment of ``st`` by ``n`` bytes: (segment, offset, fd)."""
        seg = self._open_segment(txn, st, n, created)
        s = Segment.unpack(self._must(txn.get(_BE64.pack(seg), db=self._db_segs)))
        off = s.size
        s.size += n
        txn.put(_BE64.pack(seg), s.pack(), db=self._db_segs)
        self._add(txn, f"used:{st.name}", n)
        assert st.open_fd is not None
        return seg, off, st.open_fd

    def _drop_open(self, st: _TierState) -> None:
        # the fd may still be in use by a batch that is being written: close it later
        if st.open_fd is not None:
            st.retired_fds.append(st.open_fd)
        st.open_fd = None
        st.open_seg = None

    @staticmethod
    def _close_retired(st: _TierState) -> None:
        while st.retired_fds:
            os.close(st.retired_fds.pop())

    def _segment_bytes(self, st: _TierState) -> int:
        # small tiers get small segments, so that dead space is never a large share
        return max(4 * ALIGN, min(self.config.segment_bytes, st.cfg.capacity // 16))

    def _seal_open(self, st: _TierState) -> None:
        """Seal this process's open segment of a tier (so compaction may take it)."""
        sid = st.open_seg
        if sid is None:
            return

        def seal(txn: lmdb.Transaction) -> None:
            raw = txn.get(_BE64.pack(sid), db=self._db_segs)
            if raw is not None:
                s = Segment.unpack(raw)
                s.state = SEG_SEALED
                txn.put(_BE64.pack(sid), s.pack(), db=self._db_segs)

        self._write(seal)
        self._drop_open(st)
        self._close_retired(st)

    def _open_segment(self, txn: lmdb.Transaction, st: _TierState, need: int, created: list[int]) -> int:
        if st.open_seg is not None:
            raw = txn.get(_BE64.pack(st.open_seg), db=self._db_segs)
            if raw is not None:
                s = Segment.unpack(raw)
                if s.size + need <= self._segment_bytes(st) or s.size <= ALIGN:
                    return st.open_seg
                s.state = SEG_SEALED  # an empty sealed segment is removed by compaction
                txn.put(_BE64.pack(st.open_seg), s.pack(), db=self._db_segs)
            self._drop_open(st)
        while True:
            seg_id = self._add(txn, "next_segment", 1)
            try:
                fd = st.io.create(seg_id)
                break
            except FileExistsError:
                continue  # left by a writer that died before registering it; recovery removes it
        created.append(seg_id)
        txn.put(_BE64.pack(seg_id), Segment(st.tid, SEG_OPEN, os.getpid(), ALIGN, 0, 0, time.time()).pack(),
                db=self._db_segs)
        self._add(txn, f"used:{st.name}", ALIGN)
        self._add(txn, "written_bytes", ALIGN)
        st.open_seg, st.open_fd = seg_id, fd
        return seg_id

    # -- capacity and eviction ---------------------------------------------------
    def _enforce_capacity(self, tier: str, incoming: int, trim: bool = False) -> int:
        """Evict (LRU, never pinned) until ``incoming`` more bytes fit; returns chunks evicted.
        With ``trim``, evict down to the low watermark even if they fit already."""
        st = self._tier(tier)
        cap = st.cfg.capacity
        with self._read() as txn:
            used = self._get_counter(txn, f"used:{tier}")
        incoming += ALIGN  # room for a new segment's header
        if used + incoming <= cap and not trim:
            return 0
        to_free = used + incoming - int(cap * self.config.low_watermark)
        unlink: list[tuple[str, int]] = []

        def fn(txn: lmdb.Transaction) -> int:
            freed = 0
            victims: dict[bytes, Entry] = {}
            retired = 0
            # chunks of superseded model fingerprints go first, then the policy's order
            sources = ((True, self._retired_victims(txn, st.tid)), (False, self.policy.victims(self, txn, st.tid)))
            for from_retired, keys in sources:
                for key in keys:
                    if freed >= to_free:
                        break
                    if key in victims:
                        continue
                    raw = txn.get(key, db=self._db_chunks)
                    e = None if raw is None else Entry.read(raw)
                    if e is None:
                        continue
                    victims[key] = e
                    freed += e.rec_len
                    retired += from_retired
            for key, e in victims.items():
                self._unindex_entry(txn, key, e, unlink)
            self._add(txn, "evicted_retired", retired)
            self._add(txn, "evicted", len(victims))
            return len(victims)

        n = self._write(fn)
        self._unlink(unlink)
        with self._read() as txn:
            used = self._get_counter(txn, f"used:{tier}")
        if used + incoming > cap:
            # dead space in partly live segments: reclaim it now (rare with LRU, since
            # old segments die whole)
            self.compact(tier, min_dead_ratio=0.0, until_free=used + incoming - cap)
            with self._read() as txn:
                used = self._get_counter(txn, f"used:{tier}")
            if used + incoming > cap and st.open_seg is not None:
                self._seal_open(st)
                self.compact(tier, min_dead_ratio=0.0, until_free=used + incoming - cap)
        return n

    def _retired_victims(self, txn: lmdb.Transaction, tier: int) -> Iterator[bytes]:
        """Unpinned chunks of retired namespaces (see ``retired_namespaces``) in ``tier``."""
        pins = txn.cursor(db=self._db_pins)
        for nid in sorted(self.retired_namespaces(txn)):
            cur = txn.cursor(db=self._db_chunks)
            if not cur.set_range(nid):
                continue
            for k, v in cur:
                if not bytes(k).startswith(nid):
                    break
                if v[_ENTRY_TIER_OFF] != tier:
                    continue
                key = bytes(k)
                if pins.set_key(key) and _PIN.unpack(pins.value())[0] > 0:
                    continue
                yield key

    def maintain(self, high_watermark: float = 0.95) -> dict[str, int]:
        """Background housekeeping (the daemon calls it periodically): evict any tier above
        ``high_watermark`` of its capacity down to the low watermark, compact mostly-dead
        segments and write pending access times. Returns what it did."""
        out = {"evicted": 0, "segments_compacted": 0, "bytes_reclaimed": 0, "segments_forgotten": 0}
        for name, st in self._tiers.items():
            with self._read() as txn:
                used = self._get_counter(txn, f"used:{name}")
            if used > high_watermark * st.cfg.capacity:
                with self._lock:
                    out["evicted"] += self._enforce_capacity(name, 0, trim=True)
        out["segments_forgotten"] = sum(p.kind == "missing-segment" for p in self.forget_missing_segments())
        try:
            self.compact_journal()
        except OSError as exc:
            log.warning("could not compact the metadata journal: %s", exc)
        segs, reclaimed = self.compact()
        out["segments_compacted"] += segs
        out["bytes_reclaimed"] += reclaimed
        self.flush()
        return out

    def evict(self, keys: Iterable[bytes], force: bool = False) -> tuple[int, int]:
        """Remove chunks by key; pinned ones only with ``force``. Returns (chunks, bytes)."""
        unlink: list[tuple[str, int]] = []

        def fn(txn: lmdb.Transaction) -> tuple[int, int]:
            n = b = 0
            for key in keys:
                raw = txn.get(key, db=self._db_chunks)
                if raw is None:
                    continue
                if not force:
                    pin = txn.get(key, db=self._db_pins)
                    if pin is not None and _PIN.unpack(pin)[0] > 0:
                        continue
                e = Entry.read(raw)
                if e is None:  # a damaged entry: forget it (verify --fix recounts what it counted)
                    txn.delete(key, db=self._db_chunks)
                    n += 1
                    continue
                self._unindex_entry(txn, key, e, unlink)
                n += 1
                b += e.rec_len
            self._add(txn, "evicted", n)
            return n, b

        with self._lock:
            res = self._write(fn)
            self._unlink(unlink)
        return res

    # -- compaction --------------------------------------------------------------
    def compact(self, tier: str | None = None, min_dead_ratio: float | None = None,
                until_free: int | None = None) -> tuple[int, int]:
        """Rewrite the live records of sealed segments that are mostly dead; returns
        (segments removed, bytes reclaimed)."""
        ratio = self.config.compact_dead_ratio if min_dead_ratio is None else min_dead_ratio
        tiers = [tier] if tier else list(self._tiers)
        removed = reclaimed = 0
        for tname in tiers:
            st = self._tier(tname)
            with self._read() as txn:
                cands = []
                for k, v in txn.cursor(db=self._db_segs):
                    s = Segment.unpack(v)
                    sid = _BE64.unpack(k)[0]
                    if s.tier != st.tid or s.state != SEG_SEALED or sid == st.open_seg:
                        continue
                    dead = s.size - s.live_bytes - ALIGN
                    if dead > 0 and dead >= ratio * s.size:
                        cands.append((dead, sid, s))
            cands.sort(reverse=True)
            for _dead, sid, s in cands:
                if until_free is not None and reclaimed >= until_free:
                    break
                if self._compact_segment(st, sid):
                    removed += 1
                    reclaimed += s.size
        return removed, reclaimed

    def _compact_segment(self, st: _TierState, sid: int) -> bool:
        with self._lock:
            with self._read() as txn:
                lo = _BE64.pack(sid) + _BE64.pack(0)
                cur = txn.cursor(db=self._db_locs)
                live = []
                if cur.set_range(lo):
                    for k, v in cur:
                        if k[:8] != lo[:8]:
                            break
                        live.append((_BE64.unpack(k[8:16])[0], bytes(v)))
            for off, key in live:
                with self._read() as txn:
                    raw = txn.get(key, db=self._db_chunks)
                if raw is None:
                    continue
                e = Entry.unpack(raw)
                if (e.seg, e.off) != (sid, off):
                    continue
                buf = st.io.pool.take(e.stored_len)
                data = memoryview(buf)[: e.stored_len]
                try:
                    hdr = st.io.read_record(sid, off, e.stored_len, data)
                except (CorruptRecord, SegmentGone, ValueError):
                    st.io.pool.give(buf)
                    self._drop_corrupt(key, e)
                    continue
                if trailer_mismatch(key, e, hdr):
                    st.io.pool.give(buf)
                    self._drop_corrupt(key, e)
                    continue
                # reserve in our own open segment, without evicting (compaction frees space)
                created: list[int] = []

                nseg, noff, fd = self._write(lambda txn: self._alloc(txn, st, e.rec_len, created))
                try:
                    n, _csum = st.io.write_record(fd, noff, data, functools.partial(
                        encode_header, key, hdr.codec, hdr.meta, hdr.stored_len, hdr.raw_len, created=hdr.created))
                finally:
                    st.io.pool.give(buf)
                if self.config.fsync:
                    st.io.sync(fd)
                self._close_retired(st)
                unlink: list[tuple[str, int]] = []

                def move(txn: lmdb.Transaction) -> None:
                    self._add(txn, "written_bytes", n)
                    self._add(txn, "compacted_bytes", n)
                    raw2 = txn.get(key, db=self._db_chunks)
                    if raw2 is None:
                        return
                    cur_e = Entry.unpack(raw2)
                    if (cur_e.seg, cur_e.off) != (sid, off):
                        return
                    self._unindex_entry(txn, key, cur_e, unlink)
                    cur_e.seg, cur_e.off = nseg, noff
                    self._index_entry(txn, key, cur_e)
                    # the move is not an eviction: keep pins as they were
                self._write(move)
                self._unlink(unlink)
            # the segment may still hold records of keys that were re-put elsewhere; when
            # nothing live is left it is removed by _unindex_entry; make sure here too
            unlink2: list[tuple[str, int]] = []

            def finish(txn: lmdb.Transaction) -> bool:
                raw = txn.get(_BE64.pack(sid), db=self._db_segs)
                if raw is None:
                    return True
                s = Segment.unpack(raw)
                if s.live_count > 0:
                    return False
                txn.delete(_BE64.pack(sid), db=self._db_segs)
                self._add(txn, f"used:{st.name}", -s.size)
                unlink2.append((st.name, sid))
                return True

            done = self._write(finish)
            self._unlink(unlink2)
            return done

    # -- reading -----------------------------------------------------------------
    def info(self, key: bytes) -> ChunkInfo | None:
        with self._read() as txn:
            raw = txn.get(key, db=self._db_chunks)
            if raw is None:
                return None
            pin = txn.get(key, db=self._db_pins)
        e = Entry.read(raw)
        return None if e is None else self._chunk_info(key, e, _PIN.unpack(pin)[0] if pin else 0)

    @staticmethod
    def _chunk_info(key: bytes, e: Entry, refs: int) -> ChunkInfo:
        return ChunkInfo(key, e.tier_name, CODEC_NAMES.get(e.codec, str(e.codec)), e.stored_len,
                         e.raw_len, e.rec_len, e.tokens, e.hits, e.created, e.last_access, refs,
                         e.layout, e.seg, e.off, e.level)

    def contains(self, key: bytes) -> bool:
        with self._read() as txn:
            return txn.get(key, db=self._db_chunks) is not None

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The tier of each key, or None where it is not stored (one read transaction)."""
        out: list[str | None] = []
        with self._read() as txn:
            for k in keys:
                raw = txn.get(k, db=self._db_chunks)
                out.append(None if raw is None else TIER_NAMES.get(raw[_ENTRY_TIER_OFF]))
        return out

    def lookup(self, ns: Namespace, tokens: Sequence[int]) -> LookupResult:
        """Longest cached prefix of ``tokens`` in namespace ``ns``."""
        keys = ns.chunk_keys(tokens)
        tiers = self.locate(keys)
        hit = 0
        for t in tiers:
            if t is None:
                break
            hit += 1
        size = ns.kv_format.chunk_size
        return LookupResult(len(tokens), hit * size, size, keys, tiers)

    def get(self, key: bytes, touch: bool = True) -> Chunk | None:
        """Read and verify one chunk; None on a miss (absent, corrupt or foreign).

        ``touch=False`` is for the store's own work (move, compress, warm): the read counts
        as neither a hit nor a miss and leaves the chunk's access time alone."""
        with self._read() as txn:
            raw = txn.get(key, db=self._db_chunks)
        if raw is None:
            if touch:
                self._count_miss()
            return None
        e = Entry.read(raw)
        out = bytearray(e.raw_len if e is not None else 0)
        res = self.get_into(key, out, touch)  # a damaged entry: dropped there, a miss
        if res is None:
            return None
        return Chunk(key, out, res.layout, res.tokens, res.tier, res.codec)

    def get_into(self, key: bytes, out: Buffer, touch: bool = True) -> ChunkInfo | None:
        """Read one chunk into ``out`` (a writable buffer of at least its raw size).

        Returns its metadata, or None on a miss. On a miss ``out`` may hold garbage.
        A chunk whose bytes fail the checksum, or whose record names another key, is
        removed from the index and counted as corrupt.
        """
        dst = memoryview(out).cast("B")
        for _attempt in range(3):
            with self._read() as txn:
                raw = txn.get(key, db=self._db_chunks)
            if raw is None:
                self._count_miss(touch)
                return None
            try:
                e = Entry.unpack(raw)
            except CorruptEntry as exc:
                log.warning("dropping chunk %s: %s", short_key(key), exc)
                self._drop_unreadable(key, bytes(raw))
                self._count_miss(touch)
                return None
            if len(dst) < e.raw_len:
                raise StoreError(f"output buffer of {len(dst)} bytes is smaller than the chunk ({e.raw_len})")
            st = self._tiers.get(e.tier_name)
            if st is None:
                self._count_miss(touch)
                return None
            try:
                if e.codec == 0 and e.stored_len != e.raw_len:
                    raise CorruptRecord(f"index entry of a raw chunk has stored length {e.stored_len} "
                                        f"and raw length {e.raw_len}")
                stored = dst if e.codec == 0 else memoryview(bytearray(e.stored_len))
                hdr = st.io.read_record(e.seg, e.off, e.stored_len, stored)
                wrong = trailer_mismatch(key, e, hdr)
                if wrong:
                    raise CorruptRecord(f"record at segment {e.seg} offset {e.off}: the index and the record "
                                        f"trailer disagree on {wrong}")
                if e.codec != 0:
                    itemsize = DTYPE_SIZES.get(e.layout.get("dtype", "uint8"), 1)
                    plain = self.codec.decode(e.codec, stored, e.raw_len, itemsize)
                    dst[: e.raw_len] = plain
            except SegmentGone:
                # compacted under us (look the key up again), or the file is really gone
                if _attempt == 2 and not os.path.exists(st.io.path(e.seg)):
                    self._forget_segment(st, e.seg)
                continue
            except (CorruptRecord, StoreError, ValueError, OverflowError, MemoryError) as exc:
                # a record or an index entry that does not add up is a miss, never wrong bytes
                log.warning("dropping corrupt chunk %s: %s", short_key(key), exc)
                self._drop_corrupt(key, e)
                self._count_miss(touch)
                return None
            if touch:
                self._touch(key)
            return self._chunk_info(key, e, 0)
        self._count_miss(touch)
        return None

    def _count_miss(self, count: bool = True) -> None:
        if not count:
            return
        with self._lock:
            self._stats_mem["misses"] += 1

    def _drop_corrupt(self, key: bytes, e: Entry) -> None:
        unlink: list[tuple[str, int]] = []

        def fn(txn: lmdb.Transaction) -> None:
            raw = txn.get(key, db=self._db_chunks)
            if raw is None:
                return
            cur = Entry.unpack(raw)
            if (cur.seg, cur.off) != (e.seg, e.off):
                return
            self._unindex_entry(txn, key, cur, unlink)
            self._add(txn, "corrupt", 1)

        with self._lock:
            self._write(fn)
            self._unlink(unlink)

    def _drop_unreadable(self, key: bytes, raw: bytes) -> None:
        """Forget an index entry that cannot be decoded. What it counted is recounted by
        ``check(fix=True)`` (the daemon's verify --fix): its location is unknown."""

        def fn(txn: lmdb.Transaction) -> None:
            if txn.get(key, db=self._db_chunks) == raw:
                txn.delete(key, db=self._db_chunks)
                self._add(txn, "corrupt", 1)

        with self._lock:
            self._write(fn)

    def _touch(self, key: bytes) -> None:
        with self._lock:
            now = time.time()
            prev = self._access.get(key)
            self._access[key] = (now, (prev[1] if prev else 0) + 1)
            self._stats_mem["hits"] += 1
            due = time.monotonic() - self._last_flush >= self.config.access_flush_s
        if due or len(self._access) > 10000:
            self.flush()

    def flush(self) -> None:
        """Write pending access times and hit/miss counts to the index."""
        with self._lock:
            pending, self._access = self._access, {}
            stats, self._stats_mem = self._stats_mem, {"hits": 0, "misses": 0}
            self._last_flush = time.monotonic()
        if self.readonly or (not pending and not any(stats.values())):
            return

        def fn(txn: lmdb.Transaction) -> None:
            for key, (ts, hits) in pending.items():
                raw = txn.get(key, db=self._db_chunks)
                if raw is None:
                    continue
                e = Entry.unpack(raw)
                txn.delete(bytes([e.tier]) + _BE64.pack(int(e.last_access * 1e9)) + key, db=self._db_lru)
                e.last_access = max(e.last_access, ts)
                e.hits += hits
                txn.put(key, e.pack(), db=self._db_chunks)
                txn.put(bytes([e.tier]) + _BE64.pack(int(e.last_access * 1e9)) + key, b"", db=self._db_lru)
            for k, v in stats.items():
                if v:
                    self._add(txn, k, v)

        self._write(fn)

    # -- pins --------------------------------------------------------------------
    def pin(self, label: str, keys: Sequence[bytes], expected_bytes: int = 0, dry_run: bool = False,
            journal: bool = True) -> int:
        """Pin ``keys`` under ``label``; keys need not be stored yet.

        ``expected_bytes`` is what each not-yet-stored chunk will take on disk; it
        counts against the pin budget until the chunk arrives. Returns the number of
        pin references added (a label pins a key at most once). Raises
        ``PinBudgetError`` (changing nothing) if the budget would be exceeded.
        ``dry_run`` does all of it, budget check included, then rolls the transaction back.
        """
        if not label or "\0" in label:
            raise StoreError("a pin label must be a non-empty string without NUL")
        lb = label.encode()
        budget_tier = self.config.default_tier

        def fn(txn: lmdb.Transaction) -> int:
            added = 0
            for key in keys:
                if len(key) != KEY_BYTES:
                    raise StoreError(f"chunk key must be {KEY_BYTES} bytes")
                lk = lb + b"\0" + key
                if txn.get(lk, db=self._db_labels) is not None:
                    continue
                txn.put(lk, _BE64.pack(int(time.time())), db=self._db_labels)
                pin = txn.get(key, db=self._db_pins)
                refs, reserved = _PIN.unpack(pin) if pin else (0, 0)
                if refs == 0:
                    raw = txn.get(key, db=self._db_chunks)
                    if raw is not None:
                        e = Entry.unpack(raw)
                        self._add(txn, f"pinned:{e.tier_name}", e.rec_len)
                    else:
                        reserved = align_up(expected_bytes) if expected_bytes else 0
                        self._add(txn, "pin_reserved", reserved)
                txn.put(key, _PIN.pack(refs + 1, reserved), db=self._db_pins)
                added += 1
            for tname, st in self._tiers.items():
                pinned = self._get_counter(txn, f"pinned:{tname}")
                if tname == budget_tier:
                    pinned += self._get_counter(txn, "pin_reserved")
                if pinned > st.cfg.pin_budget_bytes:
                    raise PinBudgetError(
                        f"pin {label!r} would put {pinned} bytes pinned in tier {tname}, over its pin "
                        f"budget of {st.cfg.pin_budget_bytes} bytes; unpin something or raise the budget")
            if dry_run:
                raise _RolledBack(added)
            return added

        try:
            added = self._write(fn)
        except _RolledBack as rb:
            return rb.value
        if added and journal:
            self._journal_add("pin", label=label, keys=[k.hex() for k in keys], expected=int(expected_bytes))
        return added

    def unpin(self, label: str, keys: Sequence[bytes] | None = None) -> int:
        """Drop ``label``'s pins on ``keys`` (all of the label's keys when None).
        Returns the number of pin references removed."""
        lb = label.encode() + b"\0"

        def fn(txn: lmdb.Transaction) -> int:
            if keys is None:
                cur = txn.cursor(db=self._db_labels)
                targets = []
                if cur.set_range(lb):
                    for k in cur.iternext(values=False):
                        if not bytes(k).startswith(lb):
                            break
                        targets.append(bytes(k[len(lb):]))
            else:
                targets = list(keys)
            removed = 0
            for key in targets:
                if not txn.delete(lb + key, db=self._db_labels):
                    continue
                removed += 1
                pin = txn.get(key, db=self._db_pins)
                if pin is None:
                    continue
                refs, reserved = _PIN.unpack(pin)
                refs -= 1
                if refs <= 0:
                    txn.delete(key, db=self._db_pins)
                    raw = txn.get(key, db=self._db_chunks)
                    if raw is not None:
                        e = Entry.unpack(raw)
                        self._add(txn, f"pinned:{e.tier_name}", -e.rec_len)
                    else:
                        self._add(txn, "pin_reserved", -reserved)
                else:
                    txn.put(key, _PIN.pack(refs, reserved), db=self._db_pins)
            return removed

        removed = self._write(fn)
        if removed:
            self._journal_add("unpin", label=label, keys=None if keys is None else [k.hex() for k in keys])
        return removed

    def pin_refs(self, key: bytes) -> int:
        with self._read() as txn:
            pin = txn.get(key, db=self._db_pins)
        return _PIN.unpack(pin)[0] if pin else 0

    def labels(self) -> dict[str, list[bytes]]:
        out: dict[str, list[bytes]] = {}
        with self._read() as txn:
            for k in txn.cursor(db=self._db_labels).iternext(values=False):
                label, _, key = bytes(k).partition(b"\0")
                out.setdefault(label.decode(), []).append(key)
        return out

    # -- listing and statistics --------------------------------------------------
    def iter_chunks(self, prefix: bytes = b"") -> Iterator[ChunkInfo]:
        """Metadata of every chunk whose key starts with ``prefix`` (e.g. a namespace id)."""
        with self._read() as txn:
            cur = txn.cursor(db=self._db_chunks)
            pins = txn.cursor(db=self._db_pins)
            if not cur.set_range(prefix):
                return
            for k, v in cur:
                if not bytes(k).startswith(prefix):
                    return
                key = bytes(k)
                refs = _PIN.unpack(pins.value())[0] if pins.set_key(key) else 0
                e = Entry.read(v)
                if e is not None:
                    yield self._chunk_info(key, e, refs)

    def stats(self) -> dict[str, Any]:
        if not self.readonly:
            self.flush()
        with self._read() as txn:
            c = {k: self._get_counter(txn, k) for k in (
                "puts", "payload_bytes", "written_bytes", "hits", "misses", "corrupt", "evicted",
                "rejected_full", "compacted_bytes", "pin_reserved", "evicted_retired")}
            tiers = {}
            for name, st in self._tiers.items():
                segs = dead = 0
                for _k, v in txn.cursor(db=self._db_segs):
                    s = Segment.unpack(v)
                    if s.tier == st.tid:
                        segs += 1
                        dead += max(0, s.size - s.live_bytes - ALIGN)
                tiers[name] = {
                    "chunks": self._get_counter(txn, f"count:{name}"),
                    "bytes": self._get_counter(txn, f"live:{name}"),
                    "disk_bytes": self._get_counter(txn, f"used:{name}"),
                    "dead_bytes": dead,
                    "segments": segs,
                    "capacity": st.cfg.capacity,
                    "pinned_bytes": self._get_counter(txn, f"pinned:{name}"),
                    "pin_budget": st.cfg.pin_budget_bytes,
                    "direct_io": st.io.direct,
                    "path": st.io.dir,
                }
        wa = c["written_bytes"] / c["payload_bytes"] if c["payload_bytes"] else 0.0
        return {"tiers": tiers, "counters": c, "write_amplification": wa}

    # -- recovery and checks -----------------------------------------------------
    def forget_missing_segments(self) -> list[Problem]:
        """Drop the index entries of sealed segments whose file is gone (deleted by hand, a
        lost disk): lookups stop reporting hits that every read would miss, usage stops
        counting them, and engines save those chunks again. A stat per segment."""
        problems: list[Problem] = []
        with self._read() as txn:
            segs = [(_BE64.unpack(k)[0], Segment.unpack(v)) for k, v in txn.cursor(db=self._db_segs)]
        absent = self._absent_tiers(segs)
        for name in absent:
            problems.append(Problem("tier-unavailable", self._absent_message(name)))
        for sid, s in segs:
            st = self._tiers.get(TIER_NAMES.get(s.tier, ""))
            if st is None or st.name in absent or s.state != SEG_SEALED or os.path.exists(st.io.path(sid)):
                continue
            n = self._forget_segment(st, sid)
            if n is not None:
                problems.append(Problem("missing-segment", f"segment {sid} of tier {st.name} vanished; "
                                        f"its {n} chunk(s) were dropped from the index", True))
                log.warning("segment %d of tier %s vanished; dropped its %d chunk(s) from the index", sid, st.name, n)
        return problems

    TIER_MARKER = ".lmctl-tier"

    def _mark_tiers(self, segs: list[tuple[int, Segment]]) -> None:
        """Put a marker file in each tier folder that is really the tier's: a new tier, or one
        where at least one registered segment file is. A folder without it (an unmounted
        disk's empty mount point, a moved folder) is never taken for lost segments."""
        for st in self._tiers.values():
            marker = os.path.join(st.io.dir, self.TIER_MARKER)
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

    def _absent_tiers(self, segs: list[tuple[int, Segment]]) -> set[str]:
        """Tiers whose folder is not the tier's (no marker, see ``_mark_tiers``): an
        unmounted disk or a moved folder, not lost segments. Their entries are never dropped
        for that."""
        absent = {st.name for st in self._tiers.values()
                  if not os.path.exists(os.path.join(st.io.dir, self.TIER_MARKER))}
        for name in absent:
            log.error("%s", self._absent_message(name))
        return absent

    def _absent_message(self, name: str) -> str:
        return (f"tier {name}: none of its segment files is in {self._tiers[name].io.dir}; is its disk mounted, "
                "or did its folder move? Its chunks are kept in the index until it is back")

    def _forget_segment(self, st: _TierState, sid: int) -> int | None:
        """Forget a registered sealed segment whose file is gone, and every entry in it."""
        unlink: list[tuple[str, int]] = []

        def fn(txn: lmdb.Transaction) -> int | None:
            raw = txn.get(_BE64.pack(sid), db=self._db_segs)
            if raw is None or os.path.exists(st.io.path(sid)):
                return None
            entries = self._entries_in_segment(txn, sid)
            for key, e in entries:
                self._unindex_entry(txn, key, e, unlink)
            cur = txn.get(_BE64.pack(sid), db=self._db_segs)
            if cur is not None:
                txn.delete(_BE64.pack(sid), db=self._db_segs)
                self._add(txn, f"used:{st.name}", -Segment.unpack(cur).size)
            return len(entries)

        with self._lock:
            n = self._write(fn)
            st.io.forget(sid)
        return n

    def recover(self) -> list[Problem]:
        """Seal segments whose writer died; drop registrations of vanished files."""
        with self._read() as txn:
            self._mark_tiers([(_BE64.unpack(k)[0], Segment.unpack(v)) for k, v in txn.cursor(db=self._db_segs)])
        problems: list[Problem] = self.forget_missing_segments()
        unlink: list[tuple[str, int]] = []

        with self._read() as txn:
            segs = [(_BE64.unpack(k)[0], Segment.unpack(v)) for k, v in txn.cursor(db=self._db_segs)]
        absent = self._absent_tiers(segs)
        for sid, s in segs:
            tname = TIER_NAMES.get(s.tier)
            st = self._tiers.get(tname or "")
            if st is None or st.name in absent or s.state != SEG_OPEN or sid == st.open_seg:
                continue
            path = st.io.path(sid)
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                fd = -1
            if fd >= 0:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    continue  # its writer is alive
            try:
                def seal(txn: lmdb.Transaction) -> None:
                    raw = txn.get(_BE64.pack(sid), db=self._db_segs)
                    if raw is None:
                        return
                    cur = Segment.unpack(raw)
                    if cur.state != SEG_OPEN:
                        return
                    if fd < 0:
                        # the file is gone: forget it and everything indexed in it
                        for key, e in self._entries_in_segment(txn, sid):
                            self._unindex_entry(txn, key, e, unlink)
                        txn.delete(_BE64.pack(sid), db=self._db_segs)
                        self._add(txn, f"used:{st.name}", -cur.size)
                        problems.append(Problem("missing-segment", f"segment {sid} vanished"))
                        return
                    # bytes past the last indexed record were never made visible: cut them
                    end = ALIGN
                    for _key, e in self._entries_in_segment(txn, sid):
                        end = max(end, e.off + e.rec_len)
                    os.ftruncate(fd, end)
                    self._add(txn, f"used:{st.name}", end - cur.size)
                    cur.size = end
                    cur.state = SEG_SEALED
                    if cur.live_count == 0:
                        txn.delete(_BE64.pack(sid), db=self._db_segs)
                        self._add(txn, f"used:{st.name}", -cur.size)
                        unlink.append((st.name, sid))
                    else:
                        txn.put(_BE64.pack(sid), cur.pack(), db=self._db_segs)
                    problems.append(Problem("orphan-segment", f"sealed segment {sid} of a dead writer", True))

                self._write(seal)
            finally:
                if fd >= 0:
                    os.close(fd)
        self._unlink(unlink)
        problems.extend(self._remove_orphan_files())
        return problems

    def _remove_orphan_files(self) -> list[Problem]:
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
        for st, sid in self._unknown_files():
            p = Problem("orphan-file", f"{segment_name(sid)} in tier {st.name} is not in the index")
            try:
                fd = os.open(st.io.path(sid), os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                with self._read() as txn:  # registered meanwhile by its (now finished) writer?
                    if txn.get(_BE64.pack(sid), db=self._db_segs) is not None:
                        continue
                    forgotten = sid <= self._get_counter(txn, "next_segment") and not any(
                        True for _ in self._entries_in_segment(txn, sid))
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

    def _unknown_files(self) -> list[tuple[_TierState, int]]:
        """Segment files on disk that the index does not know (this process's open one aside)."""
        with self._read() as txn:
            known = {_BE64.unpack(k)[0] for k in txn.cursor(db=self._db_segs).iternext(values=False)}
        return [(st, sid) for st in self._tiers.values() for sid in st.io.segment_ids()
                if sid not in known and sid != st.open_seg]

    def _entries_in_segment(self, txn: lmdb.Transaction, sid: int) -> list[tuple[bytes, Entry]]:
        lo = _BE64.pack(sid)
        cur = txn.cursor(db=self._db_locs)
        out = []
        if cur.set_range(lo):
            for k, v in cur:
                if k[:8] != lo:
                    break
                raw = txn.get(v, db=self._db_chunks)
                e = None if raw is None else Entry.read(raw)
                if e is not None:
                    out.append((bytes(v), e))
        return out

    def check(self, fix: bool = False, deep: bool = False,
              progress: Callable[[int, int], None] | None = None) -> list[Problem]:
        """Find (and with ``fix``, repair) inconsistencies between index and segments.

        ``deep`` reads every payload and verifies its checksum. Fixes: drop index
        entries whose bytes are bad or missing, delete segment files that no index
        entry refers to (leftovers of crashed writers), and recount usage counters.
        """
        problems: list[Problem] = []
        unlink: list[tuple[str, int]] = []
        with self._read() as txn:
            raw_entries = [(bytes(k), Entry.read(v)) for k, v in txn.cursor(db=self._db_chunks)]
        unreadable = [k for k, e in raw_entries if e is None]
        entries = [(k, e) for k, e in raw_entries if e is not None]
        with self._read() as txn:
            segs = {_BE64.unpack(k)[0]: Segment.unpack(v) for k, v in txn.cursor(db=self._db_segs)}
        bad: list[tuple[bytes, Entry]] = []
        absent = self._absent_tiers(list(segs.items()))
        problems.extend(Problem("tier-unavailable", self._absent_message(name)) for name in sorted(absent))
        def moved(key: bytes, e: Entry) -> bool:
            """Whether the entry changed since the snapshot (compaction or a rewrite moved the
            chunk, or it was evicted): then what looked wrong was the old place, not a problem."""
            with self._read() as txn:
                raw = txn.get(key, db=self._db_chunks)
                cur = None if raw is None else Entry.read(raw)
            return cur is None or (cur.seg, cur.off) != (e.seg, e.off)

        for i, (key, e) in enumerate(entries):
            if progress:
                progress(i + 1, len(entries))
            st = self._tiers.get(e.tier_name)
            if st is not None and st.name in absent:
                continue  # never drop a whole tier's chunks because its folder is not there
            if st is None or e.seg not in segs:
                if moved(key, e):
                    continue
                problems.append(Problem("dangling-entry", f"chunk {short_key(key)} points to missing segment {e.seg}"))
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
                    hdr = st.io.read_record(e.seg, e.off, e.stored_len, None)
                    wrong = trailer_mismatch(key, e, hdr)
                    if wrong:
                        raise CorruptRecord(f"the index and the record trailer disagree on {wrong}")
                except (CorruptRecord, SegmentGone, ValueError, OverflowError) as exc:
                    if moved(key, e):
                        continue
                    problems.append(Problem("corrupt-chunk", f"chunk {short_key(key)}: {exc}"))
                    bad.append((key, e))
        if fix and bad:
            def drop(txn: lmdb.Transaction) -> None:
                for key, e in bad:
                    raw = txn.get(key, db=self._db_chunks)
                    if raw is not None and (Entry.unpack(raw).seg, Entry.unpack(raw).off) == (e.seg, e.off):
                        self._unindex_entry(txn, key, Entry.unpack(raw), unlink)
                        self._add(txn, "corrupt", 1)

            with self._lock:
                self._write(drop)
                self._unlink(unlink)
            for p in problems:
                if p.kind in ("dangling-entry", "missing-file", "corrupt-chunk"):
                    p.fixed = True
        for k in unreadable:
            problems.append(Problem("unreadable-entry", f"chunk {short_key(k)}: its index entry cannot be decoded",
                                    fix))
        if fix and unreadable:
            def forget(txn: lmdb.Transaction) -> None:
                for k in unreadable:
                    raw = txn.get(k, db=self._db_chunks)
                    if raw is not None and Entry.read(raw) is None:
                        txn.delete(k, db=self._db_chunks)
                        self._add(txn, "corrupt", 1)

            with self._lock:
                self._write(forget)
        # files on disk that the index does not know
        if fix:
            problems.extend(self._remove_orphan_files())
        else:
            problems.extend(Problem("orphan-file", f"{segment_name(sid)} in tier {st.name} is not in the index")
                            for st, sid in self._unknown_files())
        problems.extend(self._recount(fix))
        return problems

    def _recount(self, fix: bool) -> list[Problem]:
        problems: list[Problem] = []

        def fn(txn: lmdb.Transaction) -> None:
            want: dict[str, int] = {}
            seg_live: dict[int, list[int]] = {}
            for k, v in txn.cursor(db=self._db_chunks):
                e = Entry.read(v)
                if e is None:
                    continue  # reported (and with fix, dropped) by check
                t = e.tier_name
                want[f"live:{t}"] = want.get(f"live:{t}", 0) + e.rec_len
                want[f"count:{t}"] = want.get(f"count:{t}", 0) + 1
                sl = seg_live.setdefault(e.seg, [0, 0])
                sl[0] += e.rec_len
                sl[1] += 1
                pin = txn.get(k, db=self._db_pins)
                if pin is not None and _PIN.unpack(pin)[0] > 0:
                    want[f"pinned:{t}"] = want.get(f"pinned:{t}", 0) + e.rec_len
            reserved = 0
            for k, v in txn.cursor(db=self._db_pins):
                refs, r = _PIN.unpack(v)
                if refs and txn.get(k, db=self._db_chunks) is None:
                    reserved += r
            want["pin_reserved"] = reserved
            for k, v in list(txn.cursor(db=self._db_segs)):
                s = Segment.unpack(v)
                t = TIER_NAMES[s.tier]
                want[f"used:{t}"] = want.get(f"used:{t}", 0) + s.size
                live, count = seg_live.get(_BE64.unpack(k)[0], [0, 0])
                if (s.live_bytes, s.live_count) != (live, count):
                    problems.append(Problem("segment-count", f"segment {_BE64.unpack(k)[0]} live "
                                            f"{s.live_bytes}/{s.live_count}, index says {live}/{count}", fix))
                    if fix:
                        s.live_bytes, s.live_count = live, count
                        txn.put(k, s.pack(), db=self._db_segs)
            for t in self._tiers:
                for c in ("live", "count", "pinned", "used"):
                    want.setdefault(f"{c}:{t}", 0)
            for name, want_v in want.items():
                have = self._get_counter(txn, name)
                if have != want_v:
                    problems.append(Problem("counter", f"{name} is {have}, index says {want_v}", fix))
                    if fix:
                        txn.put(b"c:" + name.encode(), _U64.pack(want_v), db=self._db_meta)

        if fix:
            with self._lock:
                self._write(fn)
        else:
            with self._read() as txn:
                fn(txn)
        return problems

    def rebuild_index(self) -> int:
        """Re-create index entries from the records in segment files alone.

        For use after the index was lost: every record whose header and checksum
        verify is indexed again (the first copy of a key wins). Returns the number
        of chunks recovered.
        """
        found = 0
        for st in self._tiers.values():
            for sid in st.io.segment_ids():
                if sid == st.open_seg:
                    continue
                size = os.path.getsize(st.io.path(sid))
                recs = []
                for off, hdr in st.io.scan(sid, size):
                    if hdr is not None and st.io.verify_payload(sid, off, hdr):
                        recs.append((off, hdr))

                def fn(txn: lmdb.Transaction, sid: int = sid, size: int = size,
                       recs: list[Any] = recs) -> int:
                    n = 0
                    if txn.get(_BE64.pack(sid), db=self._db_segs) is None:
                        txn.put(_BE64.pack(sid), Segment(st.tid, SEG_SEALED, 0, size, 0, 0, time.time()).pack(),
                                db=self._db_segs)
                        self._add(txn, f"used:{st.name}", size)
                    if self._get_counter(txn, "next_segment") < sid:
                        txn.put(b"c:next_segment", _U64.pack(sid), db=self._db_meta)
                    for off, hdr in recs:
                        if txn.get(hdr.key, db=self._db_chunks) is not None:
                            continue
                        e = Entry(sid, off, hdr.record_len, hdr.stored_len, hdr.raw_len, hdr.checksum,
                                  int(hdr.meta.get("tokens", 0)), 0, hdr.codec, st.tid, hdr.created,
                                  hdr.created, hdr.meta.get("layout", {}))
                        self._index_entry(txn, hdr.key, e)
                        n += 1
                    return n

                with self._lock:
                    found += self._write(fn)
        return found

    # -- lifecycle ---------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        if os.getpid() == self._pid:
            try:
                self.flush()
            except StoreError:
                pass
            for st in self._tiers.values():
                if not self.readonly:
                    self._seal_open(st)
                self._close_retired(st)
                st.io.close()
            self._env.close()
            if self._journal is not None:
                self._journal.close()
        self._closed = True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
