"""The store: the one object that owns a store's index, tiers and their parts.

``Store`` is a facade. The work is done by parts with one job each (see
docs/architecture.md for the map): ``index`` (LMDB schema and transactions),
``space`` (tiers and segment allocation), ``writes``, ``reads``, ``eviction``,
``compaction``, ``pins``, ``namespaces`` and ``recovery``.

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

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from .clock import SYSTEM_CLOCK, Clock
from .config import TIER_IDS, TIER_ORDER, StoreConfig, TierConfig
from .errors import ReadOnlyError, StoreError, is_read_only
from .format.codec import CODEC_NAMES, Codec, codec_id
from .format.journal import COMPACT_BYTES as JOURNAL_COMPACT_BYTES
from .format.journal import MetaJournal, replay
from .format.keys import KEY_BYTES, PARTIAL_BLOCK, Namespace, NamespaceRecord, prefix_ids, short_key
from .format.private import (
    check_file,
    check_folder,
    make_private_dir,
    open_file,
    tighten,
)
from .format.record import REC_FIXED, TRAILER_BLOCK
from .format.segment import SegmentIO
from .index import FORMAT_VERSION, Entry, Index, Txn
from .index.events import KINDS as EVENT_KINDS
from .index.events import EventLog
from .index.metrics import Cell, Gauge, Meter
from .index.schema import META_CONFIG
from .observe.announce import Announcements
from .observe.explain import explain_miss
from .observe.report import Report
from .ops.check import Checker
from .ops.compaction import Compactor
from .ops.eviction import Evictor
from .ops.meta import StoreMeta
from .ops.namespaces import Namespaces
from .ops.pins import Pins
from .ops.reads import Reads, expects
from .ops.recovery import Recovery
from .ops.writes import Writes, record_meta
from .tiers.admission import Admission, WriteRate
from .tiers.ladder import Ladder
from .tiers.sharing import Sharing, writer_id
from .tiers.space import Space, TierState
from .types import (
    Chunk,
    ChunkInfo,
    Compacted,
    Evicted,
    Explanation,
    LookupResult,
    MaintenanceResult,
    Problem,
    PutItem,
    RewriteResult,
    StoreCounts,
    StoreStats,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")

#: raw chunks compressed per maintenance pass by ``compress_cold_after_s``
COLD_BATCH = 64
#: hits waiting to be promoted into dram at most
PROMOTE_QUEUE = 64


class Store:
    """A KV chunk store on local disk. Thread-safe; open one per process (and a new one
    after ``fork``)."""

    def __init__(self, path: str | os.PathLike[str], config: StoreConfig | None = None, *,
                 readonly: bool = False, fallback_readonly: bool = False,
                 tier_paths: Mapping[str, str] | None = None, clock: Clock | None = None) -> None:
        """Open the store at ``path``, creating it (with ``config``, or the defaults) if it
        does not exist. ``config`` given for an existing store replaces its settings.
        Opening for writing recovers what crashed writers left and enforces capacities;
        an index that was lost is rebuilt from the segments and the metadata journal.

        On a read-only filesystem (EROFS from the index or a file: mounted ``ro``, or gone
        read-only after an error) a writable open raises ``ReadOnlyError``; with
        ``fallback_readonly`` (engines, the daemon) it opens read-only instead: hits are
        served, saves are refused (``ReadOnlyError``, counted in ``refused_saves``), and
        ``readonly_reason`` says why. A store whose filesystem goes read-only while it is
        open turns read-only the same way at its first refused write.

        A tier folder recorded as a relative path (an older lmctl kept ``--tier-path`` as
        typed) would be found from each process's working folder: the store is refused with a
        line that says so, unless ``tier_paths`` ({tier: absolute folder}) names that tier's
        folder, which is then recorded instead.

        ``clock`` (store/clock.py; default: the machine's) is what every part reads the time
        from: access, creation, pin and event times, ages, retry deadlines. Tests pass a
        ``ManualClock`` and move it instead of sleeping."""
        self._tier_paths = dict(tier_paths or {})
        #: what the store's parts read the time from
        self.clock: Clock = clock or SYSTEM_CLOCK
        try:
            self._start(path, config, readonly)
        except Exception as exc:
            if readonly or not fallback_readonly or not is_read_only(exc):
                raise
            log.error("store %s: %s; opening it read-only: hits are served, saves refused", path, exc)
            self._start(path, None, True, "its filesystem is read-only")

    @property
    def readonly(self) -> bool:
        """Whether nothing can be written: opened read-only, or its filesystem is read-only."""
        return self._index.readonly

    @property
    def readonly_reason(self) -> str | None:
        """Why nothing can be written (None: it can)."""
        return self._index.readonly_reason if self._index.readonly else None

    def _start(self, path: str | os.PathLike[str], config: StoreConfig | None, readonly: bool,
               readonly_reason: str | None = None) -> None:
        self.path = os.path.abspath(os.fspath(path))
        #: chunks ``put_many`` refused because the store is read-only (this process's, in memory:
        #: a read-only index cannot count them)
        self.refused_saves = 0
        self._lock = threading.RLock()
        self._closed = False
        index = os.path.join(self.path, "index")
        # only a folder no one else can change is used: each component checked, at every open
        if readonly:
            check_folder(self.path, "store folder")
            if not check_folder(index, "index folder"):
                raise StoreError(f"no store at {self.path}; create it first (open it without readonly)")
        else:
            # private whatever the umask: the folder 0700, its files 0600 (SPEC section 2)
            make_private_dir(self.path, "store folder")
            make_private_dir(index, "index folder")
        for name in ("data.mdb", "lock.mdb"):  # LMDB opens them itself: checked first
            check_file(os.path.join(index, name), "index file", written=not readonly)
        check_file(os.path.join(self.path, "meta.journal"), "metadata journal", written=not readonly)
        self._tiers: dict[str, TierState] = {}
        self._journal = None if readonly else MetaJournal(os.path.join(self.path, "meta.journal"))
        # events are written by whatever transaction makes the change they describe: the index
        # makes the log it writes them to (store/index/events.py)
        self._index = Index(index, readonly, self._remove_files, event_log_max=lambda: self.config.event_log_max,
                            readonly_reason=readonly_reason, clock=self.clock)
        try:
            self._open(config)
        except BaseException:
            # nothing may stay open: the next open of this folder in this process must work
            for st in self._tiers.values():
                st.io.close()
            if self._journal is not None:
                self._journal.close()
            sharing = getattr(self, "_sharing", None)
            if sharing is not None:
                sharing.close()
            self._index.close()
            raise

    def _open(self, config: StoreConfig | None) -> None:
        readonly = self.readonly
        # an index that is new while a journal exists: the index was lost; its settings,
        # salt key, namespaces and pins come back from the journal, its chunks from the segments
        restore = None
        self._meta = StoreMeta(self._index, self.path, self._journal_add)
        fresh = self._meta.index_is_new()
        #: this store's id (in the index and in marker files; None: an earlier version's store
        #: opened read-only): a folder or segment that names another store is never used
        self.store_id = self._meta.identify(fresh)
        if self._journal is not None and fresh and self._journal.size():
            restore = replay(self._journal.records())
            if config is None and restore["config"]:
                config = StoreConfig.from_json(restore["config"])
        self.config = self._meta.absolute_tier_paths(self._meta.load_config(config), self._tier_paths)
        events = self._index.event_log
        assert events is not None  # asked for above
        self._events: EventLog = events
        self._announce = Announcements(self._index)
        self.codec = Codec(self.config.codec_level)
        for name in TIER_ORDER:
            if name in self.config.tiers:
                self._add_tier(name)

        def cfg() -> StoreConfig:
            return self.config

        def codec() -> Codec:
            return self.codec

        self._space = Space(self._index, self._tiers, cfg, self._journal_add, self._lock, self.clock)
        self._ns = Namespaces(self._index, self.path, self._journal_add, self.clock)
        self._ns.load_salt_key(None if restore is None else restore["salt_key"])
        self._pins = Pins(self._index, self._tiers, cfg, self._journal_add)
        self._compactor = Compactor(self._index, self._space, cfg, self._lock)
        self._evictor = Evictor(self._index, self._space, self._compactor, self._ns, cfg, self._lock)
        # a boot id recorded before recovery is built: whether the machine rebooted since the
        # last writable open tells recovery that a tmpfs tier is new, not lost
        rebooted = False if readonly else self._meta.note_boot()
        self._recovery = Recovery(self._index, self._space, self.path, self._lock, self.store_id, rebooted=rebooted,
                                  clock=self.clock)
        self._checker = Checker(self._index, self._space, self._recovery, self._lock, clock=self.clock)
        self._sharing: Sharing | None = None
        self._remote_refused: str | None = None  # why the configured remote tier did not start
        # the access log has a lock of its own: a hit never waits for a write holding the store's
        self._reads = Reads(self._index, self._tiers, cfg, codec, self._recovery.forget_segment,
                            threading.RLock(), before_flush=(self._meter_remote,), clock=self.clock)
        self._admission = Admission(self._index, cfg, self.clock)
        self._ladder = Ladder(self._tiers, lambda: self._sharing)
        self._writes = Writes(self._index, self._space, self._evictor, self._reads, cfg, codec, self._lock,
                              self._admission, self._ladder, clock=self.clock)
        self._report = Report(self._index, self._tiers, self._reads, self._admission, cfg, lambda: self._sharing,
                              lambda: self._remote_refused, self.clock)
        self._share(self.config)
        self._promote_lock = threading.Lock()
        self._promoting: set[bytes] = set()
        self._promoter: ThreadPoolExecutor | None = None
        if not readonly:
            fixed = tighten(self.path, [st.io.dir for st in self._tiers.values()])
            if fixed:
                log.warning("made %d files and folders of store %s private (0700 folders, 0600 files); "
                            "they were open to other users: %s", len(fixed), self.path,
                            ", ".join(f"{os.path.relpath(p, self.path)} ({m:04o})" for p, m in fixed[:6])
                            + (", ..." if len(fixed) > 6 else ""))
            if self._meta.format_version() < FORMAT_VERSION:
                self._checker.build_counts()  # before anything changes an entry
            self.recover()
            if restore is not None or (self._meta.index_is_empty() and self._segment_files()):
                self._recovery.restore(restore, self._ns, self._pins)
            for name in self._tiers:
                self._writes.make_room(name, 0)
            # what the open wrote (settings, salt key, boot id, restored pins) survives a power cut
            self._index.sync()
        else:
            for st in self._tiers.values():
                self._recovery.check_marker(st)

    # -- the remote tier -------------------------------------------------------------------
    @property
    def has_remote(self) -> bool:
        """Whether this store has a remote tier (lookups and reads may then ask a server)."""
        return self._sharing is not None

    @property
    def remote_reachable(self) -> bool:
        """Whether the remote tier's calls go to the server now (its circuit breaker is not
        open: after failures, calls are answered as misses without the network)."""
        sharing = self._sharing
        return sharing is not None and sharing.tier.breaker.state != sharing.tier.breaker.OPEN

    def _new_sharing(self, config: StoreConfig) -> Sharing | None:
        """The remote tier ``config`` asks for (None: none, or the one open now is it);
        ``StoreError`` if it cannot start (no secret, a secret file that fails its checks)."""
        old = self._sharing
        if config.remote is None or self.readonly or (old is not None and config.remote == old.cfg):
            return None
        return Sharing(config.remote, lambda: self.codec, writer_id(self.path), self.clock)

    def _promote_remote(self, sharing: Sharing, info: ChunkInfo, data: Buffer) -> None:
        """Store locally a chunk just read from the remote tier (when its settings say so):
        the facade does it, so the remote tier never calls back into the write path."""
        item = sharing.to_promote(info, data)
        if item is None:
            return
        try:
            _check_put(item)  # a head's layout and tokens are the server's word: checked as a caller's
            if self._writes.put_many([item], share=False)[0]:
                sharing.count_promoted()
        except StoreError as exc:  # a full local disk: the read still succeeded
            log.warning("could not promote remote chunk %s: %s", info.key[16:24].hex(), exc)

    def _share(self, config: StoreConfig, new: Sharing | None = None) -> None:
        """Open (or, when its settings changed, reopen) the remote tier of ``config`` (``new``:
        made already). At open, a remote tier that cannot start is left off with one error
        line (``stats().remote_refused`` says why): the store serves its local tiers."""
        old = self._sharing
        if old is not None and config.remote == old.cfg:
            return
        self._remote_refused = None
        if new is None:
            try:
                new = self._new_sharing(config)
            except StoreError as exc:
                log.error("store %s: the remote tier does not start: %s", self.path, exc)
                self._remote_refused = str(exc)
        if old is not None:
            old.close()
        self._sharing = new  # what the write path pushes to (``Writes``'s ``remote``)

    def _meter_remote(self, meter: Meter) -> None:
        """Add what the remote tier's counters did since the last flush to the metrics."""
        sharing = self._sharing
        if sharing is not None:
            sharing.meter(meter)

    def count_lookup(self, ns: Namespace, hit_tokens: int, tokens: int) -> None:
        """Count an engine's lookup of a prompt of ``tokens`` tokens that found ``hit_tokens``
        cached, per model and adapter (metrics ``lookups_total``, ``lookup_hit_tokens_total``,
        ``lookup_miss_tokens_total``)."""
        m = self._reads.meter
        who = {"model": ns.model, "adapter": "" if ns.adapter is None else ns.adapter.name}
        m.inc("lookups_total", 1, **who)
        m.inc("lookup_hit_tokens_total", hit_tokens, **who)
        m.inc("lookup_miss_tokens_total", max(0, tokens - hit_tokens), **who)
        self._flush_if_due()

    def set_gauge(self, name: str, value: float, **labels: str) -> None:
        """Set this process's current value of a gauge (e.g. an engine's save queue depth,
        labelled by its pid); written with the access log, read by ``metric_gauges``."""
        if self._reads.meter.gauge(name, value, **labels):
            self._flush_if_due()

    def metric_gauges(self, max_age_s: float | None = 60.0) -> list[Gauge]:
        """The gauges every process set within ``max_age_s`` seconds (this process's pending
        values included; nothing is written, so this never waits for the disk)."""
        return self._reads.metric_gauges(max_age_s)

    def metric_cells(self) -> list[Cell]:
        """The metric totals of every process that used this store (store/index/metrics.py): what
        they flushed (each within its ``access_flush_s``) plus this process's pending counts,
        added in memory (nothing is written, so this never waits for the disk)."""
        return self._reads.metric_cells()

    def _promotes(self, info: ChunkInfo | None) -> bool:
        """Whether a hit on ``info`` moves the chunk up the ladder: it is below the top local
        tier, and the top tier is where saves go (the default tier)."""
        top = self._ladder.top()
        return info is not None and info.tier != top and self.config.default_tier == top

    def _promote(self, key: bytes) -> None:
        """Move a chunk that was just read from a lower local tier to the top one (dram, the
        default tier), in the background; at most ``PROMOTE_QUEUE`` waiting, more are skipped
        (a later hit retries)."""
        top = self._ladder.top()

        def move() -> None:
            try:
                self.flush()  # its access time first, so that it arrives on top as recently used
                self._writes.rewrite([key], tier=top)
            except StoreError as exc:
                log.debug("could not promote chunk %s to %s: %s", key[16:24].hex(), top, exc)
            finally:
                with self._promote_lock:
                    self._promoting.discard(key)

        if self.readonly or self.pin_refs(key):
            return  # pinned chunks stay where they are: dram has a pin budget of its own
        with self._promote_lock:
            if key in self._promoting or len(self._promoting) >= PROMOTE_QUEUE or self._closed:
                return
            if self._promoter is None:
                self._promoter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmctl-promote")
            try:
                self._promoter.submit(move)
            except RuntimeError:  # shutting down
                return
            self._promoting.add(key)

    # -- settings ------------------------------------------------------------------------
    def _add_tier(self, name: str, cfg: TierConfig | None = None) -> None:
        cfg = cfg or self.config.tiers[name]
        d = cfg.path or os.path.join(self.path, name)
        io = SegmentIO(d, readonly=self.readonly, what=f"{name} folder", store_id=self.store_id, clock=self.clock)
        self._tiers[name] = TierState(name, TIER_IDS[name], cfg, io)

    def eviction_plan(self, config: StoreConfig) -> dict[str, tuple[list[tuple[bytes, int]], str | None]]:
        """What ``configure(config)`` would evict at once, changing nothing: by tier, the
        ``(key, bytes on disk)`` of each chunk in eviction order (retired namespaces first,
        then least recently used; never a pinned chunk unless it moves), and the tier they
        would move to (None: they would be dropped). Settings ``configure`` refuses are
        refused here too. Compaction of dead space, which ``configure`` may also run, is not
        counted."""
        self._meta.check_change(config, self._tiers)
        out: dict[str, tuple[list[tuple[bytes, int]], str | None]] = {}
        with self._lock:
            for name in self._tiers:
                if name not in config.tiers:  # removed: it holds nothing
                    continue
                victims, moves = self._evictor.plan(name, config.tiers[name].capacity, config.low_watermark,
                                                    self._writes.spill_moves(name))
                below = self._ladder.local_below(name)
                out[name] = (victims, below if moves else None)
        return out

    def configure(self, config: StoreConfig) -> None:
        """Replace the store's settings (capacities, budgets, codec, new tiers) and apply
        them now (a tier over its new capacity is evicted down). A tier's folder cannot
        change; a tier is removed only while it holds no chunks (its segment files, all dead
        records, are deleted; its folder stays). The new settings are synced to disk before
        this returns."""
        removed = self._meta.check_change(config, self._tiers)
        old_events_max = self.config.event_log_max
        old_ghosts = self.config.admit_ghosts
        sharing = self._new_sharing(config)  # a remote tier that cannot start refuses the settings, changing nothing
        with self._lock:
            # a new tier's folder first: checked and marked (or refused) before anything changes
            added = [name for name in TIER_ORDER if name in config.tiers and name not in self._tiers]
            try:
                for name in added:
                    self._add_tier(name, config.tiers[name])
                if added:  # a new tier's folder is the tier's: mark it, or checks take it for a lost disk
                    self._recovery.mark_tiers(self._recovery.segments())
            except BaseException:
                for name in added:
                    if name in self._tiers:
                        self._tiers.pop(name).io.close()
                raise
            def write(t: Txn) -> None:
                for name in removed:  # checked in the transaction that removes it: no chunk arrives meanwhile
                    self._meta.check_empty(t, name, config)
                    for sid, seg in t.segments():
                        if seg.tier == TIER_IDS[name]:
                            t.drop_segment(name, sid, seg)
                t.put("meta", META_CONFIG, config.to_json().encode())

            for name in removed:  # its open segment closed first, so that its file goes too
                self._space.drop_open(self._tiers[name])
                self._space.close_retired(self._tiers[name])
            try:
                self._index.write(write, durable=True)
            except BaseException:
                for name in added:
                    self._tiers.pop(name).io.close()
                if sharing is not None:
                    sharing.close()
                raise
            for name in removed:
                self._tiers.pop(name).io.close()
            self._journal_add("config", config=config.to_json())
            self.config = config
            self.codec = Codec(config.codec_level)
            for name, st in self._tiers.items():
                st.cfg = config.tiers[name]
            if config.event_log_max < old_events_max:  # a smaller log: drop its oldest events now
                self._index.write(lambda t: self._events.trim(t))
            if config.admit_ghosts < old_ghosts:  # a smaller ghost list: forget what its ring lost
                self._index.write(lambda t: self._admission.trim(t, config.admit_ghosts))
            self._share(config, sharing)  # before making room: a smaller tier spills as the new settings say
            for name in self._tiers:
                self._writes.make_room(name, 0)

    # -- the metadata journal (store/format/journal.py) -------------------------------------------
    def format_version(self) -> int:
        """The format of the index (1: written before the counts were kept)."""
        return self._meta.format_version()

    def _segment_files(self) -> bool:
        return any(st.io.segment_ids() for st in self._tiers.values())

    def _journal_add(self, op: str, **fields: Any) -> None:
        if self._journal is None:
            return
        try:
            self._journal.append(op, **fields)
        except OSError as exc:  # the index holds the change; only a later rebuild would miss it
            log.warning("could not add to the metadata journal %s: %s", self._journal.path, exc)

    def _remove_files(self, dropped: list[tuple[str, int]]) -> None:
        self._space.remove_files(dropped)

    def _journal_snapshot(self) -> list[bytes]:
        recs = [MetaJournal.encode("config", config=self.config.to_json())]
        if self._ns.salt_key is not None:
            recs.append(MetaJournal.encode("salt_key", key=self._ns.salt_key.hex()))
        for nid, doc in self._ns.all().items():
            recs.append(MetaJournal.encode("ns", id=nid.hex(), doc=doc))
        for name, keys in self._pins.labels().items():
            recs.append(MetaJournal.encode("pin", label=name, keys=[k.hex() for k in keys]))
        return recs

    def compact_journal(self, force: bool = False) -> bool:
        """Rewrite the metadata journal as a snapshot of the index once it has grown past
        its limit (or now, with ``force``); returns whether it did."""
        if self._journal is None or (not force and self._journal.size() < JOURNAL_COMPACT_BYTES):
            return False
        self._journal.replace(self._journal_snapshot)
        return True

    # -- namespaces ------------------------------------------------------------------------
    def salt_digest(self, cache_salt: str | None) -> str | None:
        """The keyed digest that namespace records keep instead of ``cache_salt`` (None: unsalted)."""
        return self._ns.salt_digest(cache_salt)

    def register_namespace(self, ns: Namespace, info: dict[str, Any] | None = None) -> bytes:
        """Record a namespace (and optional facts such as the tokenizer source) for operators,
        and note that an engine uses it now. The record keeps a keyed digest of the cache
        salt, never the salt. Returns the namespace id."""
        return self._ns.register(ns, info)

    def namespaces(self) -> dict[bytes, dict[str, Any]]:
        """Namespace records by ns_id: ``{"namespace": {model, kv_format, adapter,
        model_fingerprint, salt_digest}, "info": {...}, "updated": time}``."""
        return self._ns.all()

    def namespace_records(self) -> dict[bytes, tuple[NamespaceRecord, dict[str, Any]]]:
        """Each recorded namespace parsed, with its raw record; unreadable records are skipped."""
        return self._ns.parsed()

    def retired_namespaces(self) -> set[bytes]:
        """Namespaces of a model fingerprint that has been superseded: an engine has served
        the same model id with another fingerprint (a new checkpoint) since, and none has
        used this one for ``retire_after_s``. Their chunks can never be hit again by the
        current checkpoint, so eviction takes them first."""
        return self._evictor.retired()

    # -- writing ---------------------------------------------------------------------------
    def put(self, key: bytes, data: Buffer, layout: dict[str, Any], tokens: int = 0,
            codec: str | None = None) -> bool:
        """Store one chunk; see ``put_many``."""
        return self.put_many([PutItem(key, data, layout, tokens, codec)])[0]

    def put_many(self, items: Sequence[PutItem], tier: str | None = None, *, level: int | None = None) -> list[bool]:
        """Store chunks in one batch: one reservation, the records written with hashing
        overlapping the disk, one sync per segment (with ``fsync``), one commit. With
        ``fsync``, the commit is durable (survives a power cut) within ``SYNC_SOON_S`` (1 s)
        of the return: a background sync (see docs/architecture.md, "The sync policy").

        Returns, per item, whether it was stored. A chunk that is already present is
        not written again; a chunk that does not fit (the tier is full of pinned
        chunks, or the chunk is larger than the tier) is dropped and counted, never
        raised: a cache that cannot store simply misses later. With ``admit =
        "second-hit"``, a chunk saved to the nvme tier for the first time is not stored
        either (``save_many`` tells it apart). When the default tier's disk
        is full or read-only, the batch spills to the next local tier (see ``Writes.save``).
        ``DiskFullError`` when the disk itself is full and no tier takes the batch (nothing
        of it is stored); ``ReadOnlyError`` when the store is read-only (``readonly``; the
        refused chunks are counted in ``refused_saves``).
        """
        return [o == "stored" for o in self.save_many(items, tier, level=level)]

    def save_many(self, items: Sequence[PutItem], tier: str | None = None, *, level: int | None = None) -> list[str]:
        """``put_many``, saying what became of each chunk: ``stored``; ``present`` (it was
        stored already); ``not-admitted`` (the ``admit`` setting kept it off the nvme tier
        until its key is seen again: store/tiers/admission.py; not an error); ``no-room`` (the tier
        is full of pinned chunks, or the chunk is larger than the tier). An engine's writer
        calls this to count each apart."""
        for it in items:  # before anything is reserved or written: nothing of the batch then
            _check_put(it)
        t0 = self.clock.monotonic()
        try:
            if self.readonly:
                raise ReadOnlyError(f"{len(items)} chunk(s) not stored: {self.readonly_reason}")
            stored, where, declined = self._writes.save(items, tier, level=level)
        except ReadOnlyError:
            with self._lock:
                self.refused_saves += len(items)
            raise
        n = sum(stored)
        if n:
            m = self._reads.meter
            m.inc("saves_total", n, tier=where)
            m.inc("save_bytes_total", sum(memoryview(it.data).nbytes for it, ok in zip(items, stored, strict=True)
                                          if ok), tier=where)
            m.observe("save_seconds", self.clock.monotonic() - t0, tier=where)
        if n or any(declined):
            self._flush_if_due()
        out = ["stored" if ok else "not-admitted" if no else "" for ok, no in zip(stored, declined, strict=True)]
        if "" in out:  # not stored: present already, or no room
            there = self._reads.locate([it.key for it, o in zip(items, out, strict=True) if not o])
            found = iter(there)
            out = [o or ("present" if next(found) is not None else "no-room") for o in out]
        return out

    def _flush_if_due(self) -> None:
        """``Reads.flush_if_due`` after a count: an index that cannot be written now (a disk gone
        read-only) must not turn the save or lookup that counted into an error."""
        try:
            self._reads.flush_if_due()
        except StoreError as exc:
            log.debug("writing the metric counts failed: %s", exc)

    def rewrite(self, keys: Sequence[bytes], tier: str | None = None, codec: str | None = None,
                level: int | None = None, progress: Callable[[int, int], None] | None = None,
                dry_run: bool = False) -> RewriteResult:
        """Move chunks to ``tier`` and/or re-encode them with ``codec`` (at ``level``).

        Each chunk is read (and verified), written anew, and its index entry switched in
        one transaction; pins, hit counts and access times carry over. Chunks already in
        that tier with that codec and level are skipped. ``dry_run`` writes nothing and
        estimates ``bytes_after`` by encoding up to 8 sampled chunks. ``tier="remote"`` puts
        each chunk to the remote tier and drops it locally (pinned chunks are skipped)."""
        if tier == "remote":
            if self._sharing is None:
                raise StoreError("this store has no remote tier; configure one (remote.url) first")

            def read(key: bytes) -> tuple[Chunk, ChunkInfo] | None:
                info = self.info(key)
                chunk = self.get(key, touch=False) if info is not None else None
                return None if chunk is None or info is None else (chunk, info)

            return self._sharing.move_here(keys, read, lambda ks: self.evict(ks, reason="moved-remote"), self.pin_refs,
                                           progress, dry_run)
        return self._writes.rewrite(keys, tier, codec, level, progress, dry_run)

    def read_stored(self, key: bytes) -> tuple[Entry, bytearray] | str:
        """What ``copy_to_remote`` puts of a locally stored chunk, read (a caller may read the
        next chunk while it puts this one): its index entry and stored (encoded) bytes,
        verified; ``gone`` when no local tier holds it, ``unreadable`` when its bytes fail
        verification."""
        for _attempt in range(5):  # compaction may relocate the chunk under us: read it again
            with self._index.read() as t:
                raw = t.entry_raw(key)
            e = None if raw is None else Entry.read(raw)
            if e is None:
                return "gone"
            data = self._reads.stored_bytes(key, e)
            if data is not None:
                return e, data
        return "unreadable"

    def copy_to_remote(self, key: bytes, stored: tuple[Entry, bytearray] | str | None = None) -> tuple[str, int]:
        """Put one locally stored chunk to the remote tier as it is stored (its encoded bytes,
        verified on the way out) and keep the local copy (``lmctl drain``); ``stored``: what
        ``read_stored(key)`` returned (None: read it here). One put is one server
        transaction: the chunk is whole in the remote tier or not there. Returns
        (``copied``, stored bytes), (``gone``, 0) when no local tier holds it (evicted
        meanwhile), (``unreadable``, 0) when its bytes fail verification, or (``refused``, 0)
        when the server did not take it (down, full, breaker open, a chunk it cannot hold)."""
        sharing = self._sharing
        if sharing is None:
            raise StoreError("this store has no remote tier; configure one (remote.url) first")
        got = self.read_stored(key) if stored is None else stored
        if isinstance(got, str):
            return got, 0
        e, data = got
        try:
            from .tiers.remote import RemoteMeta

            meta = RemoteMeta(raw_len=e.raw_len, codec=CODEC_NAMES[e.codec], level=e.level, layout=e.layout,
                              tokens=e.tokens, checksum=e.checksum)
            took = sharing.tier.put(key, data, meta)
        except StoreError as exc:  # a chunk the tier cannot hold (too large, odd metadata)
            log.warning("remote tier refused chunk %s: %s", key[16:24].hex(), exc)
            took = False
        return ("copied", len(data)) if took else ("refused", 0)

    def log_remote_copies(self, keys: Sequence[bytes], nbytes: int, reason: str = "drain") -> None:
        """Log chunks just copied to the remote tier (``copy_to_remote``) as one event of kind
        ``remote-copy``: ``lmctl events`` says they are in the remote tier now."""
        if keys:
            self._index.write(lambda t: t.event("remote-copy", reason, list(keys), tier="remote", bytes=nbytes))

    # -- reading ---------------------------------------------------------------------------
    def info(self, key: bytes) -> ChunkInfo | None:
        """Index metadata of one chunk (no read of its bytes); None if it is not stored."""
        return self._reads.info(key)

    def contains(self, key: bytes) -> bool:
        """Whether ``key`` has an index entry (its bytes are not read)."""
        return self._reads.contains(key)

    def locate(self, keys: Sequence[bytes], remote: bool = True) -> list[str | None]:
        """The tier of each key, or None where it is not stored (one read transaction; then,
        with a remote tier and ``remote``, one pipelined round trip for what the local tiers lack)."""
        tiers = self._reads.locate(keys)
        sharing = self._sharing  # one snapshot: configure() may swap it meanwhile
        if remote and sharing is not None:
            tiers = sharing.locate(keys, tiers)
        return tiers

    def locate_checked(self, keys: Sequence[bytes]) -> tuple[list[str | None], int]:
        """``locate``, and how many of the keys the local tiers lack the remote tier did not
        answer for (down, slow, its breaker open): None for those means "not known", not
        "stored nowhere". 0 without a remote tier."""
        tiers = self._reads.locate(keys)
        sharing = self._sharing
        if sharing is None:
            return tiers, 0
        return sharing.locate_checked(keys, tiers)

    def lookup(self, ns: Namespace, tokens: Sequence[int], remote: bool = True, *,
               block: int | None = PARTIAL_BLOCK) -> LookupResult:
        """Longest stored prefix of ``tokens`` in namespace ``ns``: the local index, then (with
        a remote tier) the remote tier for the chunks after the local prefix.

        ``block``: the granularity, in tokens, at which the chunk after the stored full
        chunks is looked up for a partial hit (a request's tail record, or the leading
        blocks of a full chunk through an alias): ``LookupResult.partial``. An engine gives
        its block size; None looks up full chunks only. All in one index transaction."""
        found = self._reads.lookup(ns, tokens, block)
        return self.lookup_remote(ns, tokens, found, block) if remote else found

    def lookup_remote(self, ns: Namespace, tokens: Sequence[int], found: LookupResult,
                      block: int | None = PARTIAL_BLOCK) -> LookupResult:
        """``found`` (``lookup(..., remote=False)``'s answer) extended by the remote tier:
        the full chunks the local tiers lack and, with ``block``, the partial keys of the
        first chunk not stored whole (tail records, alias values), pipelined in one round
        trip within the tier's lookup deadline. Without a remote tier, ``found`` itself."""
        sharing = self._sharing
        return found if sharing is None else sharing.lookup(ns, tokens, found, block)

    def get(self, key: bytes, touch: bool = True, *, expect: int | None = None) -> Chunk | None:
        """Read and verify one chunk; None on a miss (absent, corrupt, foreign or of the wrong
        length).

        ``expect``: the exact raw length the caller wants. Without it the chunk may hold at
        most one chunk of its namespace's KV format (when the index records the namespace,
        ``key[:16]``), else ``READ_CAP`` (1 GiB). The lengths a record claims are checked
        against that before anything is allocated: a chunk that claims other lengths is a
        miss, dropped and counted (``bad-length``).
        ``touch=False`` is for the store's own work (move, compress, warm): the read counts
        as neither a hit nor a miss and leaves the chunk's access time alone. A chunk only the
        remote tier holds is read from there (and promoted into the local default tier)."""
        limit = expect if expect is not None else self._reads.read_bound(key)
        chunk = self._reads.get(key, touch, expect, limit)
        sharing = self._sharing
        if chunk is None and sharing is not None and touch:
            got = sharing.fetch_into(key, None, expect=expect, limit=limit)
            if got is not None:
                info, data = got
                self._promote_remote(sharing, info, data)
                return Chunk(key, data, info.layout, info.tokens, "remote", info.codec)
        return chunk

    def get_into(self, key: bytes, out: Buffer, touch: bool = True, *,
                 expect: int | None = None) -> ChunkInfo | None:
        """Read one chunk into ``out`` (a writable buffer); its bytes land in
        ``out[:raw_bytes]``.

        Returns its metadata, or None on a miss. On a miss ``out`` may hold garbage.
        ``expect``: the exact raw length the caller wants (an engine: its KV format's
        ``chunk_bytes``); without it, a chunk of at most ``len(out)`` bytes. The lengths a
        record claims are checked against that before anything is read: a chunk that claims
        others is a miss, removed from the index and counted (``bad-length``), as is one whose
        bytes fail the checksum or whose record names another key (``bad-record``) or whose
        read fails on a disk error (``io-error``). A chunk only the remote tier holds is read
        from there, verified, decoded into ``out`` and promoted (``tier`` is ``remote``).
        """
        view = memoryview(out).cast("B")
        if expect is not None and expect > len(view):
            raise StoreError(f"get_into: the buffer of {len(view)} bytes cannot take the {expect} expected")
        t0 = self.clock.monotonic()
        info = self._reads.get_into(key, view, touch, expect)
        if touch and info is not None and self._promotes(info):
            self._promote(key)
        sharing = self._sharing
        if info is None and sharing is not None and touch:
            got = sharing.fetch_into(key, view, expect=expect, limit=len(view))
            info = None if got is None else got[0]
            if got is not None:
                self._promote_remote(sharing, *got)
        if info is not None and touch:
            m = self._reads.meter
            m.inc("loads_total", 1, tier=info.tier)
            m.inc("load_bytes_total", info.raw_bytes, tier=info.tier)
            m.observe("load_seconds", self.clock.monotonic() - t0, tier=info.tier)
        return info

    def get_many_into(self, keys: Sequence[bytes], outs: Sequence[Buffer], touch: bool = True, *,
                      expect: int | Sequence[int | None] | None = None) -> list[ChunkInfo | None]:
        """``get_into`` of each key into its own buffer (distinct, writable), read together:
        one index lookup, and the raw records of page-aligned buffers read whole, several in
        flight (the disk's best pattern; see docs/performance.md). Each result is what
        ``get_into`` of that key would return: its metadata, or None on a miss (its buffer
        may then hold garbage), with the same checks, counts and drops. An engine loading a
        request's chunks passes them all here and uses the hits up to the first miss.
        ``expect``: one length for every chunk, or one per chunk (a partial chunk is shorter)."""
        views = [memoryview(o).cast("B") for o in outs]
        if len(views) != len(keys):
            raise StoreError(f"get_many_into: {len(keys)} keys but {len(views)} buffers")
        wants = expects(expect, len(keys))
        for v, want in zip(views, wants, strict=True):
            if want is not None and want > len(v):
                raise StoreError(f"get_many_into: a buffer of {len(v)} bytes cannot take the {want} expected")
        t0 = self.clock.monotonic()
        infos = self._reads.get_many_into(keys, views, touch, wants)
        if not touch:
            return infos
        sharing = self._sharing
        m = self._reads.meter
        for i, info in enumerate(infos):
            if info is not None and self._promotes(info):
                self._promote(keys[i])
            if info is None and sharing is not None:
                got = sharing.fetch_into(keys[i], views[i], expect=wants[i], limit=len(views[i]))
                info = infos[i] = None if got is None else got[0]
                if got is not None:  # promoted as get_into's are (a record found through an alias: with them)
                    self._promote_remote(sharing, *got)
            if info is not None:
                m.inc("loads_total", 1, tier=info.tier)
                m.inc("load_bytes_total", info.raw_bytes, tier=info.tier)
        hits = [i for i in infos if i is not None]
        if hits:  # one observation for the batch, spread over its chunks
            each = (self.clock.monotonic() - t0) / len(hits)
            for info in hits:
                m.observe("load_seconds", each, tier=info.tier)
        return infos

    def flush(self) -> None:
        """Write pending access times and hit/miss counts to the index (reads keep them in
        memory and flush every ``access_flush_s``)."""
        self._reads.flush()

    def iter_chunks(self, prefix: bytes = b"", after: bytes | None = None) -> Iterator[ChunkInfo]:
        """Metadata of every chunk whose key starts with ``prefix`` (e.g. a namespace id),
        in key order (only keys after ``after``, when given: a listing's cursor); read a page
        at a time, so no snapshot is held while the caller works."""
        return self._reads.iter_chunks(prefix, after)

    def iter_labelled(self, label: str, after: bytes | None = None) -> Iterator[ChunkInfo]:
        """Metadata of the stored chunks that ``label`` pins, in key order (after ``after``,
        when given), a page of the label's keys per read transaction."""
        last = after or b""
        while True:
            keys = self._pins.label_page(label, last)
            if not keys:
                return
            yield from self._reads.infos(keys)
            last = keys[-1]

    def counts(self) -> StoreCounts:
        """Chunks, bytes and pinned chunks per namespace and tier, and per label: kept by the
        index as the store changes, so this reads a few records, never the chunks (a store
        written by an older lmctl and opened read-only is counted instead)."""
        return self._reads.counts()

    # -- eviction and compaction -------------------------------------------------------------
    def evict(self, keys: Iterable[bytes], force: bool = False, *, reason: str = "operator",
              uid: int | None = None) -> Evicted:
        """Remove chunks by key; pinned ones only with ``force``. Returns (chunks, bytes). The
        event log records it with ``reason`` and the ``uid`` that asked (the daemon's peer)."""
        return self._evictor.evict(keys, force, reason, uid)

    def compact(self, tier: str | None = None, min_dead_ratio: float | None = None,
                until_free: int | None = None) -> Compacted:
        """Rewrite the live records of sealed segments whose dead share is at least
        ``min_dead_ratio`` (default: the store's setting) and remove the segments, most
        dead first, until ``until_free`` bytes are reclaimed. Returns (segments, bytes)."""
        return self._compactor.compact(tier, min_dead_ratio, until_free)

    def maintain(self, high_watermark: float = 0.95) -> MaintenanceResult:
        """Background housekeeping (the daemon calls it periodically): evict any tier above
        ``high_watermark`` of its capacity down to the low watermark, forget vanished
        segments, compact the journal and mostly-dead segments, write pending access times,
        and compress a batch of cold raw chunks (``compress_cold_after_s``). Returns what it
        did."""
        out = MaintenanceResult()
        if not self.check_writable():  # every step writes: nothing to do until the store can write again
            return out
        for name, st in self._tiers.items():
            if self._space.used(name) > high_watermark * st.cfg.capacity:
                with self._lock:
                    out.evicted += self._writes.make_room(name, 0, trim=True)
        out.segments_forgotten = sum(p.kind == "missing-segment" for p in self.forget_missing_segments())
        try:
            self.compact_journal()
        except OSError as exc:
            log.warning("could not compact the metadata journal: %s", exc)
        out.segments_compacted, out.bytes_reclaimed = self.compact()
        self.flush()
        if self.config.compress_cold_after_s > 0:
            out.chunks_compressed = self._compress_cold()
        return out

    def check_writable(self) -> bool:
        """Whether the store can still be written; one whose filesystem went read-only turns
        read-only now (``readonly``) instead of at its next refused write. The probe writes
        nothing: it opens the metadata journal for writing, which a read-only filesystem refuses
        (EROFS). A frozen filesystem blocks it: call it off every request's path (maintenance)."""
        if self.readonly:
            return False
        try:
            fd = open_file(os.path.join(self.path, "meta.journal"), os.O_WRONLY | os.O_APPEND | os.O_CREAT,
                           "metadata journal")
        except OSError as exc:
            if not is_read_only(exc):
                return True  # another trouble: the next write reports it
            self._index.went_read_only(f"its filesystem went read-only ({exc.strerror})")
            return False
        os.close(fd)
        return True

    def _compress_cold(self, batch: int = COLD_BATCH) -> int:
        """Compress up to ``batch`` raw chunks unread for ``compress_cold_after_s`` (oldest first)."""
        before = self.clock.time() - self.config.compress_cold_after_s
        done = 0
        for st in self._tiers.values():
            keys = self._reads.coldest(st.tid, before, codec_id("raw"), batch - done)
            if keys:
                done += self.rewrite(keys, codec="zstd-shuffle", level=1).chunks
        return done

    # -- pins ------------------------------------------------------------------------------
    def pin(self, label: str, keys: Sequence[bytes], expected_bytes: int = 0, dry_run: bool = False,
            journal: bool = True, *, uid: int | None = None) -> int:
        """Pin ``keys`` under ``label``; keys need not be stored yet.

        ``expected_bytes`` is what each not-yet-stored chunk will take on disk; it
        counts against the default tier's pin budget until the chunk arrives. Returns the
        number of pin references added (a label pins a key at most once). Raises
        ``PinBudgetError`` (changing nothing) if a budget would be exceeded.
        ``dry_run`` does all of it, budget check included, then rolls the transaction back.
        A pin (like an unpin) is synced to disk before it returns: it survives a power cut.
        A chunk that only the remote tier holds cannot be pinned (``StoreError``): the server
        evicts what it likes unless it runs with ``maxmemory-policy noeviction``.
        """
        if self._sharing is not None and journal:
            tiers = self.locate(keys)
            remote = sum(t == "remote" for t in tiers)
            if remote:
                raise StoreError(f"{remote} of these chunks are only in the remote tier ({self._sharing.url}), "
                                 "which cannot promise not to evict them; warm or move them into a local tier "
                                 "first, then pin")
        return self._pins.pin(label, keys, expected_bytes, dry_run, journal, uid)

    def unpin(self, label: str, keys: Sequence[bytes] | None = None, *, uid: int | None = None) -> int:
        """Drop ``label``'s pins on ``keys`` (all of the label's keys when None).
        Returns the number of pin references removed. Pins and unpins are logged as events,
        with the ``uid`` that asked (the daemon passes its peer's)."""
        return self._pins.unpin(label, keys, uid)

    def pin_refs(self, key: bytes) -> int:
        """How many labels pin ``key``."""
        return self._pins.refs(key)

    def key_labels(self, key: bytes) -> list[str]:
        """The labels that pin ``key``, sorted."""
        return self._pins.labels_of(key)

    def labels(self) -> dict[str, list[bytes]]:
        """Every pin label and the keys it pins."""
        return self._pins.labels()

    # -- the event log and explanations (store/index/events.py, store/observe/explain.py) -----------------
    def prefix_ids(self, tokens: Sequence[int], chunk_size: int, limit: int | None = None) -> list[bytes]:
        """The id of the token prefix that each full chunk of ``tokens`` ends (of the first
        ``limit`` chunks), the same in every namespace: give it with each chunk stored
        (``PutItem.prefix``) so that ``explain`` can tell which namespaces hold a prefix.
        Keyed with this store's secret (a hash of token ids that means nothing elsewhere);
        empty for a store that has no secret yet (never opened for writing)."""
        secret = self._ns.salt_key
        return [] if secret is None else prefix_ids(tokens, chunk_size, secret, limit)

    def explain(self, ns: Namespace, tokens: Sequence[int], found: LookupResult | None = None) -> Explanation | None:
        """Why the first chunk of ``tokens`` that misses in ``ns`` misses (None: nothing
        misses): a reason code (``never-stored``, ``other-adapter``, ``other-adapter-version``,
        ``other-salt``, ``other-model``, ``other-model-fingerprint``, ``other-kv-format``,
        ``evicted``, ``corrupt``, ``save-dropped``, ``remote-unavailable``) and a sentence,
        from the event log, the namespaces that hold the same token prefix and the remote
        tier's state. ``found``: the lookup already made."""
        if found is None:
            found = self.lookup(ns, tokens)
        return explain_miss(self, ns, tokens, found, self._events, self._index, self._sharing)

    def record_dropped_saves(self, drops: Sequence[tuple[bytes | None, str]], detail: str = "") -> None:
        """Log saves an engine dropped (``(chunk key or None, reason)``: ``queue-full``,
        ``disk-full``, ``failed``), in one write transaction for the whole batch: engines batch
        them (``engine_hook.transfer.ChunkWriter``)."""
        if not drops:
            return
        by_reason: dict[str, tuple[list[bytes], list[int]]] = {}
        for key, why in drops:
            keys, count = by_reason.setdefault(why, ([], [0]))
            count[0] += 1
            if key is not None:
                keys.append(key)

        def fn(t: Txn) -> None:
            for why, (keys, count) in by_reason.items():
                t.event("save-dropped", why, keys, chunks=count[0], detail=detail)

        self._index.write(fn)

    def events(self, since: float | None = None, kinds: Sequence[str] | None = None,
               limit: int = 100, after: int | None = None) -> list[dict[str, Any]]:
        """The newest ``limit`` events (0: all) of the store's bounded event log since the time
        ``since``, of ``kinds`` (``evict``, ``corrupt``, ``save-dropped``, ``pin``, ``unpin``,
        ``remote-copy``),
        after the event whose ``seq`` is ``after`` (for a reader that follows the log),
        oldest first. Each is a dict: ``seq``, ``time``, ``kind``, ``reason``, ``chunks``, and
        as it applies ``key`` (the first chunk it names), ``tier``, ``bytes``, ``label``,
        ``uid``, ``detail``."""
        bad = sorted(set(kinds or ()) - set(EVENT_KINDS))
        if bad:
            raise StoreError(f"unknown event kind(s) {', '.join(bad)}; kinds are {', '.join(EVENT_KINDS)}")
        return self._events.recent(since, kinds, limit, after)

    def event_keys(self, seq: int) -> list[bytes]:
        """The chunks event ``seq`` names, all of them (an event's ``key`` is only the first),
        as far as the log's bound kept them; empty once the event was dropped."""
        return self._events.keys_of(seq)

    def announced(self, note: Sequence[tuple[bytes, int, bytes]] = (), forget: Sequence[bytes] = (),
                  log: Mapping[str, Sequence[bytes]] | None = None, detail: str = "",
                  counts: Mapping[str, int] | None = None) -> None:
        """What an engine announced to routers, in one write transaction: keep the records of
        ``note`` (``(chunk key, chain position, record)``, for its re-announce after a
        restart: store/observe/announce.py), drop those of ``forget``, and log one ``announce`` event
        per reason of ``log`` (``stored``, ``removed``, ``reannounced`` -> the chunks), which
        ``lmctl events --kind announce`` shows; ``counts``: how many chunks each reason's
        event counts, when not as many as it names. Nothing when the store cannot be written."""
        logged = {r: list(k) for r, k in (log or {}).items() if k}
        if not (note or forget or logged) or not self._announce.usable():
            return

        def fn(t: Txn) -> None:
            if note:
                self._announce.note(t, note)
            if forget:
                self._announce.forget(t, forget)
            for reason, keys in logged.items():
                t.event("announce", reason, keys, chunks=(counts or {}).get(reason, len(keys)), detail=detail)

        self._index.write(fn)

    def announcements(self, after: bytes | None = None, limit: int = 256) -> list[tuple[bytes, int, bytes, bytes]]:
        """A page of announcement records, chain roots first: ``(row, position, chunk key,
        record)``; pass the last row as ``after`` for the next page."""
        return self._announce.page(after, limit)

    def announcement_of(self, keys: Sequence[bytes]) -> dict[bytes, tuple[int, bytes]]:
        """The chain position and announcement record of each of ``keys`` that has one."""
        return self._announce.get(keys)

    def last_event_seq(self) -> int:
        """The ``seq`` of the newest event ever logged (0: none): a follower of the log asks
        ``events(after=...)`` from here."""
        return self._events.last_seq()

    def event_counters(self) -> dict[str, dict[str, int]]:
        """Totals by event kind and reason, kept in the index beside the event log and never
        dropped with it: ``{"evictions_total": {"lru": n, "retired": n, "operator": n, ...},
        "corrupt_total": {...}, "saves_dropped_total": {"queue-full": n, "disk-full": n},
        "pins_total": {...}, "unpins_total": {...}}`` (chunks; pin references for pins)."""
        return self._events.counters()

    # -- statistics ------------------------------------------------------------------------
    def stats(self) -> StoreStats:
        """Usage per tier and the store's counters, as committed (this process's pending hit
        and miss counts added; other processes' arrive within their ``access_flush_s``). Reads
        only: a stalled disk under the index's writers never makes this wait."""
        return self._report.stats()

    def write_rates(self) -> dict[str, WriteRate]:
        """Bytes written to the nvme tier (all time, the last 24 h, the rate per day projected
        from them) and its write budget (``tiers.nvme.write_budget``), kept in the index so that
        every process's writes count and a restart keeps the day (store/tiers/admission.py). Empty
        for a store without an nvme tier."""
        return self._report.write_rates()

    def admission_stats(self) -> dict[str, Any]:
        """The ``admit`` setting and what it did: keys the ghost list remembers (and may), and
        the chunks (and their bytes) kept off the nvme tier, by path (``put``: an engine's
        save to nvme; ``spill``: a chunk dropped as it left dram), every process's."""
        return self._report.admission_stats()

    def warnings(self, rates: Mapping[str, WriteRate] | None = None) -> list[str]:
        """What the operator should act on soon, a line each: a tier on course to write more
        per day than its write budget (``rates``: ``write_rates()`` already read)."""
        return self._report.warnings(rates)

    def notes(self) -> list[str]:
        """What an operator should know about how the store is set up, a line each: a tier
        called dram whose folder is not in memory (on the store's disk, say)."""
        return self._report.notes()

    def release_memory(self, above: int = 0) -> bool:
        """Drop the index's mapped pages from this process's resident memory when more than
        ``above`` bytes of files are mapped in (they stay in the page cache; the next access
        maps them again). A long-running process that reads much of a large index (the
        daemon) calls it to keep its memory bounded. Returns whether it released."""
        if self._closed or (above and self._index.resident_file_bytes() <= above):
            return False
        self._index.release_pages()
        return True

    # -- recovery and checks -----------------------------------------------------------------
    def recover(self) -> list[Problem]:
        """Seal segments whose writer died (cutting bytes it never indexed), forget segments
        whose file vanished, and remove segment files that are garbage for certain. Run at
        every open for writing."""
        return self._recovery.recover()

    def forget_missing_segments(self) -> list[Problem]:
        """Drop the index entries of sealed segments whose file is gone (deleted by hand, a
        lost disk): lookups stop reporting hits that every read would miss, usage stops
        counting them, and engines save those chunks again. A tier whose folder is not
        there at all (an unmounted disk) is reported and left alone. A stat per segment."""
        return self._recovery.forget_missing_segments()

    def unavailable_tiers(self) -> dict[str, str]:
        """Tiers whose folder is not the tier's now (an unmounted disk, a moved folder), each
        with a sentence saying so; their chunks are kept in the index until they are back. A
        stat per tier, nothing logged: cheap enough for every health check."""
        return {name: self._recovery.absent_message(name) for name in sorted(self._recovery.unavailable())}

    def check(self, fix: bool = False, deep: bool = False,
              progress: Callable[[int, int], None] | None = None) -> list[Problem]:
        """Find (and with ``fix``, repair) inconsistencies between the index and the segments.

        ``deep`` reads every payload and verifies its checksum and trailer. Fixes: drop
        index entries whose bytes are bad or missing and entries that cannot be decoded,
        delete segment files that are garbage for certain (see ``recover``), and recount
        drifted counters."""
        return self._checker.check(fix, deep, progress)

    def rebuild_index(self) -> int:
        """Re-create index entries from the records in segment files alone.

        For use after the index was lost: every record whose trailer and checksum
        verify is indexed again (the first copy of a key wins). Returns the number
        of chunks recovered."""
        return self._recovery.rebuild_index()

    # -- lifecycle ---------------------------------------------------------------------------
    def close(self) -> None:
        """Flush access times, seal this process's open segments and close the index."""
        if self._closed:
            return
        try:
            if os.getpid() == self._index._pid:
                with self._promote_lock:
                    promoter, self._promoter = self._promoter, None
                    self._closed = True  # no new promotions
                if promoter is not None:
                    promoter.shutdown(wait=True, cancel_futures=True)
                self._reads.cancel_timer()
                try:
                    self.flush()
                except StoreError:
                    pass
                for st in self._tiers.values():
                    if not self.readonly:
                        self._space.seal_open(st)
                    self._space.close_retired(st)
                    st.io.close()
                if self._journal is not None:
                    self._journal.close()
                if self._sharing is not None:
                    self._sharing.close()
        finally:
            self._index.close()
            self._closed = True

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_put(it: PutItem) -> None:
    """Refuse a chunk no record can hold (``StoreError`` saying what is wrong), before any of
    its batch is written: the trailer's fields are fixed-width and it is one 4 KiB block."""
    if not isinstance(it.key, bytes) or len(it.key) != KEY_BYTES:
        raise StoreError(f"a chunk key must be {KEY_BYTES} bytes, not {type(it.key).__name__} of length "
                         f"{len(it.key) if isinstance(it.key, (bytes, str)) else '?'}")
    what = f"chunk {short_key(it.key)}…"
    try:
        memoryview(it.data)
    except TypeError:
        raise StoreError(f"{what}: its data must be a bytes-like buffer, not {type(it.data).__name__}") from None
    if isinstance(it.tokens, bool) or not isinstance(it.tokens, int) or not 0 <= it.tokens < 2**32:
        raise StoreError(f"{what}: tokens must be a whole number from 0 to 2**32 - 1, not {it.tokens!r:.40}")
    if not isinstance(it.layout, dict) or not isinstance(it.layout.get("dtype", ""), str):
        raise StoreError(f"{what}: its layout must be a dict whose dtype is a name (such as 'bfloat16')")
    if it.prefix is not None and (not isinstance(it.prefix, bytes) or len(it.prefix) != 16):
        raise StoreError(f"{what}: a token prefix id is 16 bytes (one of Store.prefix_ids)")
    if it.aliases is not None:
        if not isinstance(it.aliases, list) or len(it.aliases) > 4096:
            raise StoreError(f"{what}: aliases must be a list of at most 4096 (key, tokens) pairs")
        for a in it.aliases:
            if (not isinstance(a, tuple) or len(a) != 2 or not isinstance(a[0], bytes) or len(a[0]) != KEY_BYTES
                    or a[0][:16] != it.key[:16] or isinstance(a[1], bool) or not isinstance(a[1], int)
                    or not 0 < a[1] < it.tokens):
                raise StoreError(f"{what}: an alias is a (key of the chunk's own namespace, tokens from 1 to "
                                 f"the chunk's {it.tokens} - 1) pair")
    if it.codec is not None and not isinstance(it.codec, str):
        raise StoreError(f"{what}: codec must be a codec's name, not {type(it.codec).__name__}")
    try:
        meta = json.dumps(record_meta(it), separators=(",", ":"), sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as exc:  # ValueError: NaN or infinity, which JSON has no words for
        raise StoreError(f"{what}: its layout must be JSON of strings and finite numbers ({exc})") from None
    room = TRAILER_BLOCK - REC_FIXED - KEY_BYTES
    if len(meta) > room:
        raise StoreError(f"{what}: its layout and token count take {len(meta)} bytes of JSON, more than the "
                         f"{room} a record's trailer holds; keep the layout to dtype and shape")
