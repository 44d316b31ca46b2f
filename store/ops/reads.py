"""Reads: finding chunks, reading and verifying their bytes, and the access log.

Every read checks the record's checksum and its trailer against the index entry; a
chunk that fails is dropped from the index and counted as corrupt, and the read is a
miss, never wrong bytes. Hits and access times are kept in memory and written to the
index in batches (``flush``) by a background timer, at most ``access_flush_s`` after
they happen: a read, a lookup or a save never waits for a write transaction of its own
(a disk that stalls, e.g. frozen, stalls the timer, never the read).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from ..clock import SYSTEM_CLOCK, Clock
from ..config import TIER_NAMES, StoreConfig
from ..errors import CorruptEntry, IndexReopened, StoreError
from ..format.codec import CODEC_NAMES, Codec, max_encoded
from ..format.keys import DTYPE_SIZES, NS_ID_BYTES, Namespace, NamespaceRecord, boundary_keys, chain_hash, short_key
from ..format.record import RecordTrailer
from ..format.segment import CorruptRecord, SegmentGone
from ..index import (
    ENTRY_CODEC_OFFSET,
    ENTRY_TIER_OFFSET,
    Entry,
    Index,
    Txn,
    drop_corrupt,
    drop_unreadable,
    entry_delta,
    origin_of,
    trailer_mismatch,
    unpack_counts,
)
from ..index.metrics import (
    GAUGE_PREFIX,
    PREFIX,
    Cell,
    Gauge,
    Meter,
    add_to_cells,
    parse_cells,
    parse_gauges,
    put_gauges,
)
from ..index.schema import COUNT_LABEL, COUNT_LABEL_KEYS, COUNT_NS, lru_chunk, lru_key
from ..tiers.space import TierState
from ..types import Chunk, ChunkInfo, Counts, LookupResult, PartialHit, StoreCounts

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")

#: chunks listed per read transaction by ``iter_chunks`` (no snapshot is held between pages)
PAGE = 512
#: chunks whose access times wait in memory at most (while the index cannot be written, e.g.
#: its disk is frozen); reads of other chunks still count as hits but keep their LRU place
MAX_PENDING = 100_000
#: the most raw bytes ``get`` takes of a chunk whose namespace the index does not record,
#: when its caller names no length (pass ``expect`` for larger ones)
READ_CAP = 1 << 30
#: namespaces whose chunk size ``read_bound`` keeps in memory at most
NS_CACHE = 4096
#: errnos of a read that say the disk failed (the chunk is dropped); any other OSError (too
#: many open files, say) is this process's trouble: a miss, the chunk kept
DISK_FAULTS = frozenset({errno.EIO, errno.ENXIO, errno.ENODEV, errno.EBADMSG, errno.EUCLEAN})


def length_problem(e: Entry, expect: int | None, limit: int) -> str | None:
    """What is wrong with the lengths entry ``e`` claims, for a reader that wants exactly
    ``expect`` raw bytes (None: any) and can take at most ``limit``; None if nothing is."""
    if expect is not None and e.raw_len != expect:
        return f"its index entry claims {e.raw_len} raw bytes, the reader expects {expect}"
    if e.raw_len > limit:
        return f"its index entry claims {e.raw_len} raw bytes, more than the {limit} the reader takes"
    if e.codec == 0 and e.stored_len != e.raw_len:
        return f"its index entry claims a raw chunk of stored length {e.stored_len} and raw length {e.raw_len}"
    if e.stored_len > max_encoded(e.codec, e.raw_len):
        return f"its index entry claims {e.stored_len} stored bytes for {e.raw_len} raw bytes"
    return None


def expects(expect: int | Sequence[int | None] | None, n: int) -> list[int | None]:
    """The exact raw length wanted of each of ``n`` chunks: one for all, or one each."""
    if expect is None or isinstance(expect, int):
        return [expect] * n
    wants = list(expect)
    if len(wants) != n:
        raise StoreError(f"{n} keys but {len(wants)} expected lengths")
    return wants


def agrees(key: bytes, e: Entry, trailer: RecordTrailer | None) -> None:
    """``CorruptRecord`` unless ``trailer`` is there and says what index entry ``e`` of ``key`` says."""
    if trailer is None:
        raise CorruptRecord(f"no record trailer at segment {e.seg} offset {e.off}")
    wrong = trailer_mismatch(key, e, trailer)
    if wrong:
        raise CorruptRecord(f"record at segment {e.seg} offset {e.off}: the index and the record "
                            f"trailer disagree on {wrong}")


def chunk_info(key: bytes, e: Entry, refs: int) -> ChunkInfo:
    return ChunkInfo(key, e.tier_name, CODEC_NAMES.get(e.codec, str(e.codec)), e.stored_len,
                     e.raw_len, e.rec_len, e.tokens, e.hits, e.created, e.last_access, refs,
                     e.layout, e.seg, e.off, e.level, origin_of(e))


class Reads:
    """Lookups, verified reads and the batched access log of one store."""

    def __init__(self, index: Index, tiers: dict[str, TierState], config: Callable[[], StoreConfig],
                 codec: Callable[[], Codec], forget_segment: Callable[[TierState, int], object],
                 lock: threading.RLock, before_flush: Sequence[Callable[[Meter], None]] = (),
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.index = index
        self.clock = clock  # access times, and when the access log is due
        self.tiers = tiers
        self._config = config
        self._codec = codec
        self._forget_segment = forget_segment
        self.lock = lock
        self._access: dict[bytes, tuple[float, int]] = {}
        self._chunk_bytes: dict[bytes, int] = {}  # namespace id -> its chunk's raw bytes (read_bound)
        self._counts = {"hits": 0, "misses": 0}
        self._last_flush = clock.monotonic()
        #: this process's pending metric deltas (store/index/metrics.py), written with the access log
        self.meter = Meter(clock)
        self._timer: threading.Timer | None = None
        self._flushing = False  # a timed flush is under way (at most one: it may be stalled by the disk)
        self._flushed = threading.Condition(lock)  # notified when a timed flush ends
        self._stopped = False  # the store is closing: no more timed flushes
        #: called at the start of every flush (to add what others count, e.g. the remote tier's calls)
        self.before_flush: tuple[Callable[[Meter], None], ...] = tuple(before_flush)

    # -- the index only ----------------------------------------------------------------
    def info(self, key: bytes) -> ChunkInfo | None:
        with self.index.read() as t:
            raw = t.entry_raw(key)
            refs = t.pin(key)[0] if raw is not None else 0
        e = None if raw is None else Entry.read(raw)
        return None if e is None else chunk_info(key, e, refs)

    def contains(self, key: bytes) -> bool:
        with self.index.read() as t:
            return t.entry_raw(key) is not None

    def locate(self, keys: Sequence[bytes], again: bool = True) -> list[str | None]:
        out: list[str | None] = []
        try:
            with self.index.read() as t:
                for k in keys:
                    raw = t.entry_raw(k)
                    out.append(None if raw is None else TIER_NAMES.get(raw[ENTRY_TIER_OFFSET]))
        except IndexReopened:
            if not again:
                raise
            return self.locate(keys, again=False)
        return out

    def lookup(self, ns: Namespace, tokens: Sequence[int], block: int | None = None,
               again: bool = True) -> LookupResult:
        """See ``Store.lookup``: the full chunks' tiers and, after the last stored one, the
        longest partial hit at a ``block`` boundary, in one read transaction."""
        keys = ns.chunk_keys(tokens)
        cs = ns.kv_format.chunk_size
        found = LookupResult(len(tokens), cs, keys, [])
        try:
            with self.index.read() as t:
                for k in keys:
                    raw = t.entry_raw(k)
                    found.tiers.append(None if raw is None else TIER_NAMES.get(raw[ENTRY_TIER_OFFSET]))
                if block is not None and 0 < block < cs:
                    found.partial = self._partial(t, ns, tokens, keys, found.hit_chunks, block)
        except IndexReopened:
            if not again:
                raise
            return self.lookup(ns, tokens, block, again=False)
        return found

    @staticmethod
    def _partial(t: Txn, ns: Namespace, tokens: Sequence[int], keys: list[bytes], c: int,
                 block: int) -> PartialHit | None:
        """The longest leading part of chunk ``c`` that a record holds: a tail record under
        the partial key itself, or a full chunk's record through an alias. Whatever the index
        says is checked: the namespace, the token counts, the target's entry."""
        cs = ns.kv_format.chunk_size
        cands = boundary_keys(ns, chain_hash(ns, keys, c), tokens[c * cs : (c + 1) * cs], block)
        for n, k in reversed(cands):
            if n >= cs:
                continue  # the full chunk's own key, which missed
            raw = t.entry_raw(k)
            if raw is not None:
                e = Entry.read(raw)
                tier = None if e is None else TIER_NAMES.get(e.tier)
                if e is not None and tier is not None and e.tokens == n:
                    return PartialHit(c, k, n, n, tier)
            got = t.alias(k)
            if got is None:
                continue
            target, tok = got
            if tok != n or target[:NS_ID_BYTES] != k[:NS_ID_BYTES]:
                continue  # not an alias this store wrote for these tokens
            raw = t.entry_raw(target)
            e = None if raw is None else Entry.read(raw)
            tier = None if e is None else TIER_NAMES.get(e.tier)
            if e is not None and tier is not None and n < e.tokens <= cs:
                return PartialHit(c, target, n, e.tokens, tier, alias=k)
        return None

    def coldest(self, tier: int, before: float, codec: int, limit: int) -> list[bytes]:
        """Up to ``limit`` chunks of ``tier`` in codec ``codec`` last read before ``before``,
        least recently used first (the LRU order; one read transaction)."""
        out: list[bytes] = []
        with self.index.read() as t:
            end = lru_key(tier, before, b"")
            for k in t.keys("lru", bytes([tier]), start=lru_key(tier, 0.0, b"")):
                if k >= end or len(out) >= limit:
                    break
                key = lru_chunk(k)
                raw = t.entry_raw(key)
                if raw is not None and raw[ENTRY_CODEC_OFFSET] == codec:
                    out.append(key)
        return out

    def infos(self, keys: Sequence[bytes]) -> list[ChunkInfo]:
        """``info`` of each stored key of ``keys`` (one read transaction)."""
        out: list[ChunkInfo] = []
        with self.index.read() as t:
            for k in keys:
                raw = t.entry_raw(k)
                e = None if raw is None else Entry.read(raw)
                if e is not None:
                    out.append(chunk_info(k, e, t.pin(k)[0]))
        return out

    def counts(self, t: Txn | None = None) -> StoreCounts:
        """See ``Store.counts`` (in snapshot ``t`` when given)."""
        if t is None:
            with self.index.read() as rt:
                return self.counts(rt)
        out = StoreCounts()
        if not self.index.has_counts:
            return self._count_by_scan(t)
        for k, v in t.rows("counts"):
            kind = k[:1]
            if kind == COUNT_LABEL_KEYS:
                out.label_keys[bytes(k[1:]).decode(errors="replace")] = int.from_bytes(v[:8], "little")
                continue
            nid, tier = bytes(k[-17:-1]), TIER_NAMES.get(k[-1], str(k[-1]))
            c = Counts(*unpack_counts(v))
            if kind == COUNT_NS:
                out.namespaces.setdefault(nid, {})[tier] = c
            elif kind == COUNT_LABEL:
                label = bytes(k[1:-18]).decode(errors="replace")
                out.labels.setdefault(label, {}).setdefault(nid, {})[tier] = c
        return out

    def _count_by_scan(self, t: Txn) -> StoreCounts:
        """Counts taken from the entries (a format-1 store opened read-only keeps none)."""
        out = StoreCounts()
        for k, v in t.rows("chunks"):
            e = Entry.read(v)
            if e is None:
                continue
            key = bytes(k)
            pinned = t.pinned(key)
            c = out.namespaces.setdefault(key[:16], {}).setdefault(e.tier_name, Counts())
            c.add(Counts(*entry_delta(e, pinned)))
        for k in t.keys("labels"):
            label_b, _, key = k.partition(b"\0")
            label = label_b.decode(errors="replace")
            out.label_keys[label] = out.label_keys.get(label, 0) + 1
            e = t.entry(key)
            if e is not None:
                c = out.labels.setdefault(label, {}).setdefault(key[:16], {}).setdefault(e.tier_name, Counts())
                c.add(Counts(*entry_delta(e, True)))
        return out

    def iter_chunks(self, prefix: bytes = b"", after: bytes | None = None) -> Iterator[ChunkInfo]:
        """Chunks whose key starts with ``prefix``, in key order (after ``after``, when
        given), read a page per short read transaction (no snapshot is held while the
        caller works on a page)."""
        start, last = prefix, None
        if after is not None and after >= prefix:
            start, last = after, after
        pages = 0
        while True:
            page: list[ChunkInfo] = []
            seen = 0
            with self.index.read() as t:
                for key, v in t.rows("chunks", start=start):
                    if key == last:
                        continue
                    if not key.startswith(prefix) or seen >= PAGE:
                        break
                    seen += 1
                    last = key
                    e = Entry.read(v)
                    if e is not None:
                        page.append(chunk_info(key, e, t.pin(key)[0]))
            yield from page
            if seen < PAGE or last is None:
                return
            start = last
            pages += 1
            if pages % 16 == 0:  # a long listing would otherwise keep the whole map resident
                self.index.release_pages()

    # -- payloads ------------------------------------------------------------------------
    def read_bound(self, key: bytes) -> int:
        """The most raw bytes a chunk of ``key`` may hold when its reader names no length:
        ``namespace_bound``, else ``READ_CAP``."""
        known = self.namespace_bound(key)
        return READ_CAP if known is None else known

    def namespace_bound(self, key: bytes) -> int | None:
        """The raw bytes of one chunk of ``key``'s namespace (``key[:16]``), where the index
        records the namespace: a chunk is never larger. None where it does not."""
        nid = bytes(key[:16])
        known = self._chunk_bytes.get(nid)
        if known is not None:
            return known
        with self.index.read() as t:
            raw = t.get("namespaces", nid)
        if raw is None:
            return None
        try:
            known = NamespaceRecord.from_record(nid, json.loads(bytes(raw))["namespace"]).kv_format.chunk_bytes
        except (KeyError, TypeError, ValueError, StoreError):
            return None
        with self.lock:  # an id's KV format never changes (it is part of the id): cached for good
            if len(self._chunk_bytes) < NS_CACHE:
                self._chunk_bytes[nid] = known
        return known

    def get(self, key: bytes, touch: bool = True, expect: int | None = None,
            limit: int | None = None) -> Chunk | None:
        """See ``Store.get``. ``limit``: the most raw bytes to take (default: ``read_bound``)."""
        if limit is None:
            limit = expect if expect is not None else self.read_bound(key)
        got = self._read(key, None, touch, expect, limit)
        if got is None:
            return None
        info, out = got
        return Chunk(key, out, info.layout, info.tokens, info.tier, info.codec)

    def get_into(self, key: bytes, out: Buffer, touch: bool = True, expect: int | None = None) -> ChunkInfo | None:
        """See ``Store.get_into``."""
        view = memoryview(out).cast("B")
        got = self._read(key, view, touch, expect, len(view))
        return None if got is None else got[0]

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[memoryview], touch: bool = True,
                      expect: int | Sequence[int | None] | None = None) -> list[ChunkInfo | None]:
        """``get_into`` of each key into its buffer, the records read together: one read
        transaction finds them all, and every raw record that a page-aligned buffer can take
        whole is read in one request, several in flight on its tier's I/O threads, and
        verified in this thread as they arrive. Anything else, and any record whose fast read
        fails for whatever reason, goes through ``get_into``'s path one by one, which
        verifies, counts and drops exactly as a single read does. The buffers must be
        distinct."""
        n = len(keys)
        wants = expects(expect, n)
        out: list[ChunkInfo | None] = [None] * n
        entries: list[Entry | None] = [None] * n
        try:
            with self.index.read() as t:
                raws = [t.entry_raw(k) for k in keys]
                for i, raw in enumerate(raws):
                    if raw is not None:
                        try:
                            entries[i] = Entry.unpack(raw)
                        except CorruptEntry:
                            pass  # the single path below drops and counts it
        except IndexReopened:
            pass  # every key takes the single path, which looks it up again
        fast: list[tuple[int, TierState, Entry]] = []
        for i, e in enumerate(entries):
            if e is None or e.codec != 0 or length_problem(e, wants[i], len(outs[i])) is not None:
                continue
            st = self.tiers.get(e.tier_name)
            if st is not None and st.io.whole_read_fits(e.stored_len, outs[i]):
                fast.append((i, st, e))
        reads = []
        for i, st, e in fast:
            try:
                reads.append((i, e, st.io.start_whole_read(e.seg, e.off, e.stored_len, outs[i])))
            except Exception:  # gone, or not this store's file: the single path decides what it is
                continue
        for i, e, rd in reads:  # verified here, in order, while the I/O threads read the next ones
            try:
                agrees(keys[i], e, rd.result())
            except Exception:  # torn, moved, gone, unreadable: the single path decides what it is
                continue
            if touch:
                try:
                    self._touch(keys[i])
                except StoreError as exc:
                    log.warning("could not record a hit of chunk %s: %s", short_key(keys[i]), exc)
            out[i] = chunk_info(keys[i], e, 0)
        for i in range(n):
            if out[i] is None:
                got = self._read(keys[i], outs[i], touch, wants[i], len(outs[i]))
                out[i] = None if got is None else got[0]
        return out

    def _read(self, key: bytes, dst: memoryview | None, touch: bool, expect: int | None,
              limit: int) -> tuple[ChunkInfo, Buffer] | None:
        """Read ``key`` into ``dst`` (None: a new buffer of the chunk's size). The lengths its
        entry claims are checked against ``expect`` (the exact raw length wanted) and
        ``limit`` before anything is allocated or read."""
        for attempt in range(3):
            try:
                with self.index.read() as t:
                    raw = t.entry_raw(key)
            except IndexReopened:
                continue
            if raw is None:
                self._count_miss(touch)
                return None
            try:
                e = Entry.unpack(raw)
            except CorruptEntry as exc:
                log.warning("dropping chunk %s: %s", short_key(key), exc)
                self._guarded(drop_unreadable, self.index, key, bytes(raw))
                self._count_miss(touch)
                return None
            wrong = length_problem(e, expect, limit)
            if wrong is not None:
                # dropped when the record must be wrong: not what the caller knows the key holds,
                # or larger than its namespace's chunk; only larger than a reader's buffer or the
                # cap, it may be the reader's mistake: a miss, kept
                bound = self.namespace_bound(key)
                mine = expect is not None or e.raw_len <= limit or (bound is not None and e.raw_len > bound)
                self._failed(key, e, "bad-length", wrong, touch, drop=mine)
                return None
            st = self.tiers.get(e.tier_name)
            if st is None:
                self._count_miss(touch)
                return None
            out: Buffer
            try:
                if dst is None:
                    # a buffer is sized by the entry only once the record's checksummed trailer,
                    # on disk, says the same (a damaged entry allocates nothing)
                    agrees(key, e, st.io.trailer_at(e.seg, e.off, e.stored_len))
                    out = bytearray(e.raw_len)
                    view = memoryview(out)
                else:
                    out = view = dst
                self._read_record(st, key, e, view)
            except SegmentGone:
                # compacted under us (look the key up again), or the file is really gone
                if attempt == 2 and not os.path.exists(st.io.path(e.seg)):
                    self._forget_segment(st, e.seg)
                continue
            except OSError as exc:
                # a disk fault is a miss, never an exception into the engine
                self._failed(key, e, "io-error" if exc.errno in DISK_FAULTS else "read-error",
                             f"reading segment {e.seg} at {e.off} failed: {exc}", touch,
                             drop=exc.errno in DISK_FAULTS)
                return None
            except (CorruptRecord, StoreError, ValueError, OverflowError, MemoryError) as exc:
                # a record or an index entry that does not add up is a miss, never wrong bytes
                self._failed(key, e, "bad-record", str(exc), touch)
                return None
            if touch:
                try:
                    self._touch(key)
                except StoreError as exc:  # the access log could not be written: the hit stands
                    log.warning("could not record a hit of chunk %s: %s", short_key(key), exc)
            return chunk_info(key, e, 0), out
        self._count_miss(touch)
        return None

    def _failed(self, key: bytes, e: Entry, reason: str, detail: str, touch: bool, drop: bool = True) -> None:
        """A read of ``key`` (entry ``e``) that failed for ``reason``: a miss, counted in the
        metric ``read_failures_total``, and (``drop``) the chunk dropped from the index and
        logged as a ``corrupt`` event with that reason."""
        log.warning("%s chunk %s (%s): %s", "dropping" if drop else "missing", short_key(key), reason, detail)
        self.meter.inc("read_failures_total", 1, reason=reason, tier=e.tier_name)
        if drop:
            self._guarded(drop_corrupt, self.index, key, e, reason=reason, detail=detail)
        self._count_miss(touch)

    def _guarded(self, fn: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        """Drop a chunk from the index unless the index cannot be written now (a read-only
        store): the read is a miss either way, and dropping is only tidiness."""
        if self.index.readonly:
            return
        try:
            fn(*args, **kwargs)
        except StoreError as exc:
            log.warning("could not drop the chunk from the index: %s", exc)

    def _read_record(self, st: TierState, key: bytes, e: Entry, dst: memoryview) -> None:
        """Read and verify ``e``'s record, decoded into ``dst`` (its lengths were checked:
        ``length_problem``)."""
        if e.codec == 0:
            self._verified(st, key, e, dst)
            return
        buf = st.io.pool.take(e.stored_len)  # page-aligned and reused: read with O_DIRECT, no copy
        try:
            stored = memoryview(buf)[: e.stored_len]
            self._verified(st, key, e, stored)
            itemsize = DTYPE_SIZES.get(e.layout.get("dtype", "uint8"), 1)
            self._codec().decode_into(e.codec, stored, dst, e.raw_len, itemsize)
        finally:
            st.io.pool.give(buf)

    def stored_bytes(self, key: bytes, e: Entry) -> bytearray | None:
        """The stored (encoded) bytes of ``key``'s record ``e``, verified; None if they fail."""
        st = self.tiers.get(e.tier_name)
        if st is None or length_problem(e, None, self.read_bound(key)) is not None:
            return None
        buf = bytearray(e.stored_len)
        try:
            self._verified(st, key, e, memoryview(buf))
        except (CorruptRecord, SegmentGone, StoreError, ValueError, OSError):
            return None
        return buf

    @staticmethod
    def _verified(st: TierState, key: bytes, e: Entry, into: memoryview) -> None:
        agrees(key, e, st.io.read_record(e.seg, e.off, e.stored_len, into))

    # -- the access log ------------------------------------------------------------------
    def _count_miss(self, count: bool = True) -> None:
        if count:
            with self.lock:
                self._counts["misses"] += 1

    def _touch(self, key: bytes) -> None:
        with self.lock:
            prev = self._access.get(key)
            if prev is not None or len(self._access) < MAX_PENDING:
                self._access[key] = (self.clock.time(), (prev[1] if prev else 0) + 1)
            self._counts["hits"] += 1
            self._schedule()

    def read_lately(self, key: bytes) -> bool:
        """Whether this process read ``key`` since its last flush of the access log."""
        with self.lock:
            return key in self._access

    def flush_if_due(self) -> None:
        """After a metric count made outside reads: make sure the timer flushes it within
        ``access_flush_s`` (so the counts of a process that goes quiet still arrive). Never
        writes itself: callers are on engines' paths."""
        with self.lock:
            self._schedule()

    def _schedule(self) -> None:
        """Start the flush timer, due ``access_flush_s`` after the last flush, unless one is
        waiting or running (hold ``self.lock``)."""
        if self._timer is not None or self._flushing or self._stopped or self.index.closed:
            return
        wait = max(0.0, self._config().access_flush_s - (self.clock.monotonic() - self._last_flush))
        self._timer = threading.Timer(wait, self._timed_flush)
        self._timer.daemon = True
        self._timer.start()

    def _timed_flush(self) -> None:
        with self.lock:
            self._timer = None
            self._flushing = True
        try:
            if not self.index.closed:
                self.flush()
        except Exception as exc:  # a closed or failing index: the counts wait for the next flush
            log.debug("timed flush of the access log failed: %s", exc)
        finally:
            with self.lock:
                self._flushing = False
                self._flushed.notify_all()
                if self._access or any(self._counts.values()) or self.meter.pending():
                    self._schedule()  # what arrived while this flush ran

    def cancel_timer(self) -> None:
        """Stop timed flushes (the store is closing): the pending one is cancelled, and one
        under way is waited for, so that the index is never closed under it."""
        with self.lock:
            self._stopped = True
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()
            self._flushed.wait_for(lambda: not self._flushing)

    def _collect(self) -> None:
        """Have the ``before_flush`` hooks add what others counted to the meter."""
        for hook in self.before_flush:
            try:
                hook(self.meter)
            except Exception:  # a metric source must never stop the access log
                log.warning("collecting metrics before a flush failed", exc_info=True)

    def pending_counts(self) -> dict[str, int]:
        """This process's hits and misses not written to the index yet."""
        with self.lock:
            return dict(self._counts)

    def flush(self) -> None:
        """Write pending access times, hit/miss counts and metric deltas to the index."""
        self._collect()
        with self.lock:
            pending, self._access = self._access, {}
            counts, self._counts = self._counts, {"hits": 0, "misses": 0}
            self._last_flush = self.clock.monotonic()
            metric_counts, metric_hists = self.meter.take()
            gauges = self.meter.take_gauges()
        if self.index.readonly or (not pending and not any(counts.values()) and not metric_counts
                                   and not metric_hists and not gauges):
            return

        def fn(t: Txn) -> None:
            for key, (ts, hits) in pending.items():
                t.touch_entry(key, ts, hits)
            for k, v in counts.items():
                if v:
                    t.add(k, v)
            add_to_cells(lambda k: t.get("meta", k), lambda k, v: t.put("meta", k, v), metric_counts, metric_hists)
            put_gauges(lambda k, v: t.put("meta", k, v), gauges)

        try:
            self.index.write(fn)
        except BaseException:
            self.meter.give_back(metric_counts, metric_hists)
            raise

    def metric_cells(self) -> list[Cell]:
        """The metric totals (store/index/metrics.py): every process's flushed counts, plus this
        process's pending ones (added here in memory: nothing is written)."""
        self._collect()
        counts, hists, _gauges = self.meter.peek()
        rows = dict(self._meta_rows(PREFIX))
        add_to_cells(rows.get, rows.__setitem__, counts, hists)
        return parse_cells(sorted(rows.items()))

    def metric_gauges(self, max_age_s: float | None) -> list[Gauge]:
        """The gauges processes set within ``max_age_s`` (store/index/metrics.py), this process's
        pending values included."""
        rows = dict(self._meta_rows(GAUGE_PREFIX))
        put_gauges(rows.__setitem__, self.meter.peek()[2])
        return parse_gauges(sorted(rows.items()), max_age_s, self.clock.time())

    def _meta_rows(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        with self.index.read() as t:
            return list(t.rows("meta", prefix))
