"""The index: LMDB's sub-databases, the records kept in them, their keys, and transactions.

This module is the only one that opens LMDB and reads or writes it: every other part goes
through a ``Txn`` (named records such as ``Txn.entry`` and ``Txn.pin_label``, or rows of a
sub-database named in ``store/index/schema.py``, which declares every sub-database and key).

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
import logging
import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import IndexReopened, IndexWriteError, ReadOnlyError, StoreError, is_read_only
from ..format.private import DIR_MODE

# the index's records and its transaction, part of the index's face: the other parts import
# them from here
from .records import (  # noqa: F401
    ENTRY_CODEC_OFFSET,
    ENTRY_SIZE,
    ENTRY_TIER_OFFSET,
    ORIGIN_LOCAL,
    ORIGIN_REMOTE,
    SEG_OPEN,
    SEG_SEALED,
    Entry,
    SegmentRecord,
    entry_delta,
    entry_dtype,
    entry_head,
    origin_of,
    pack_be64,
    pack_counts,
    pack_pin,
    pack_u64,
    trailer_mismatch,
    unpack_counts,
    unpack_pin,
)
from .schema import (
    DB_NAMES,
    DbName,
)
from .txn import Txn

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
#: formats this lmctl opens (a format-1 store gets its counts built at its first writable open)
FORMATS = (1, 2)


class _MapGrown(IndexWriteError):
    """A write transaction found the map full; it was aborted and the map has grown."""


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
        #: what ``Txn.event`` writes to (see store/index/events.py); the log and the index it lives
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
