"""Writes: storing chunks in batches, and rewriting stored chunks (move, re-encode).

The payload is written (and, with ``fsync``, made durable) before the index
transaction that makes it visible commits. A batch is one reservation, writes that
overlap hashing with the disk, one sync per segment, and one commit.
"""

from __future__ import annotations

import errno
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..clock import SYSTEM_CLOCK, Clock
from ..config import StoreConfig
from ..errors import DiskFullError, ReadOnlyError, StoreError, is_read_only
from ..format.codec import CODEC_NAMES, Codec, codec_id
from ..format.keys import DTYPE_SIZES, KEY_BYTES
from ..format.record import encode_trailer, record_len
from ..index import ORIGIN_LOCAL, ORIGIN_REMOTE, Entry, Index, Txn, origin_of
from ..index.schema import META_WRITE_PROBE
from ..tiers.admission import Admission
from ..tiers.ladder import Ladder
from ..tiers.sharing import Stored
from ..tiers.space import Slot, Space, TierState
from ..types import PutItem, RewriteResult
from .eviction import Evictor
from .reads import Reads

if TYPE_CHECKING:
    from typing_extensions import Buffer

log = logging.getLogger("lmctl.store")


@dataclass
class _Prepared:
    """One item of a batch, encoded and measured before any space is reserved."""

    item: PutItem
    layout: dict[str, Any]
    codec: int
    raw: memoryview
    stored: Buffer
    rec_len: int
    created: float

    @property
    def stored_len(self) -> int:
        return len(memoryview(self.stored))


#: a tier whose disk was full (or read-only) is tried again for saves after this many seconds;
#: meanwhile its saves go to the next local tier
SPILL_RETRY_S = 10.0


class Writes:
    """The write path of one store."""

    def __init__(self, index: Index, space: Space, evictor: Evictor, reads: Reads,
                 config: Callable[[], StoreConfig], codec: Callable[[], Codec], lock: threading.RLock,
                 admission: Admission, ladder: Ladder,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        """``admission``: which saves reach the nvme tier (store/tiers/admission.py); ``ladder``:
        the store's tiers in order (store/tiers/ladder.py): where a save may land and where
        evicted chunks spill, and the remote tier as it is now (None: none), which takes the
        chunks a put stores (write ``always``) or the chunks eviction drops (write ``evict``)."""
        self.index = index
        self.admission = admission
        self.space = space
        self.evictor = evictor
        self.reads = reads
        self._config = config
        self._codec = codec
        self.lock = lock
        self.ladder = ladder
        self.clock = clock  # chunks' creation times, and when a refused tier is tried again
        #: tier -> when (monotonic) saves try it again: its disk refused the last batch
        self._refused_until: dict[str, float] = {}

    def save(self, items: Sequence[PutItem], tier: str | None = None, *,
             level: int | None = None) -> tuple[list[bool], str, list[bool]]:
        """``put_many`` for ``Store.put_many``; returns the results, the tier written to, and
        which chunks admission kept off the nvme tier (not stored, not an error).

        Saves to the default tier (``tier`` None) spill: when its disk is full (ENOSPC) or
        read-only, the batch goes to the next local tier (dram, then nvme), counted in the
        metric ``saves_spilled_total``, and that tier takes the default tier's saves for
        ``SPILL_RETRY_S`` before the default tier is tried again. A tier named by the caller
        never spills, and is never asked for admission. With ``admit = "second-hit"`` a save
        to the default tier records its keys in the ghost list, and one that goes to the nvme
        tier writes only the chunks admission lets in (store/tiers/admission.py)."""
        if tier is not None:
            return self.put_many(items, tier, level=level), tier, [False] * len(items)
        first = self._config().default_tier
        chain = self._spill_chain(first)
        for n, name in enumerate(chain):
            try:
                out, declined = self._admitted_put(items, name, level)
            except (DiskFullError, ReadOnlyError) as exc:
                if self.index.readonly or n == len(chain) - 1:
                    raise  # the index cannot be written, or no tier is left
                self._refused_until[name] = self.clock.monotonic() + SPILL_RETRY_S
                log.warning("%s; saves go to tier %s for %.0f s", exc, chain[n + 1], SPILL_RETRY_S)
                continue
            if name != first:
                self.reads.meter.inc("saves_spilled_total", sum(out), **{"from": first, "to": name})
            elif first in self._refused_until:
                del self._refused_until[first]
            return out, name, declined
        raise AssertionError("unreachable: the last tier of the chain raises")

    def _admitted_put(self, items: Sequence[PutItem], tier: str, level: int | None) -> tuple[list[bool], list[bool]]:
        """An engine's save of ``items`` to ``tier``, as admission has it: the results, and
        which items it kept off the tier."""
        adm = self.admission
        if not adm.second_hit():
            return self.put_many(items, tier, level=level), [False] * len(items)
        keys = [it.key for it in items]
        if not adm.gates(tier):  # dram: every save lands; the keys are recorded for its spill
            return self.put_many(items, tier, level=level, note=keys), [False] * len(items)
        admitted = adm.decide(keys)
        take = [it for it, ok in zip(items, admitted, strict=True) if ok]
        got = iter(self.put_many(take, tier, level=level, note=keys))
        out = [next(got) if ok else False for ok in admitted]
        declined = [not ok for ok in admitted]
        n = sum(declined)
        if n:
            m = self.reads.meter
            m.inc("not_admitted_total", n, path="put")
            m.inc("not_admitted_bytes_total", sum(memoryview(it.data).nbytes for it, d in
                                                  zip(items, declined, strict=True) if d), path="put")
        return out, declined

    def _spill_chain(self, first: str) -> list[str]:
        """The tiers a save to ``first`` may land in, in the order to try them: ``first`` and
        the local tiers after it; those whose disk refused a batch lately go last."""
        chain = self.ladder.from_(first)
        now = self.clock.monotonic()
        fresh = [n for n in chain if self._refused_until.get(n, 0.0) <= now]
        return fresh + [n for n in chain if n not in fresh]

    def put_many(self, items: Sequence[PutItem], tier: str | None = None, *, level: int | None = None,
                 replace: dict[bytes, Entry] | None = None, share: bool = True,
                 note: Sequence[bytes] = ()) -> list[bool]:
        """See ``Store.put_many``. ``replace``: keys whose current entry (as given) this
        batch replaces, for ``rewrite``; ``share``: tell ``on_stored`` (not for a rewrite or
        a chunk that came from the remote tier); ``note``: keys to record in the ghost list
        (store/tiers/admission.py) in the reserving transaction, stored or not."""
        st = self.space.tier(tier or self._config().default_tier)
        codec = self._codec()
        prepared = []
        for it in items:
            if len(it.key) != KEY_BYTES:
                raise StoreError(f"chunk key must be {KEY_BYTES} bytes, got {len(it.key)}")
            layout = dict(it.layout)
            itemsize = DTYPE_SIZES.get(layout.get("dtype", "uint8"), 1)
            cid = codec_id(it.codec or self._config().codec)
            raw = memoryview(it.data).cast("B")
            stored = codec.encode(cid, raw, itemsize, level)
            prepared.append(_Prepared(it, layout, cid, raw, stored, record_len(len(memoryview(stored))),
                                      self.clock.time()))

        with self.lock:
            needs = [(p.item.key, p.rec_len) for p in prepared]
            try:
                self.make_room(st.name, sum(n for _k, n in needs))
                plan = self.space.reserve(st, needs, replacing=set(replace or ()),
                                          also=(lambda t: self.admission.note(t, note)) if note else None)
            except OSError as exc:  # a new segment file could not be made
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskFullError(f"the disk under tier {st.name} ({st.io.dir}) is full: no room for a new "
                                        "segment file; free space there or lower the tier's capacity") from None
                if is_read_only(exc):
                    raise self._read_only(st, len(prepared)) from None
                raise
            done, written = self._write_records(st, prepared, plan)
            results = [False] * len(prepared)
            if not done:
                return results

            def commit(t: Txn) -> None:
                payload = 0
                for i, p, seg, off, csum in done:
                    key = p.item.key
                    created, last, hits = p.created, p.created, 0
                    origin = p.item.origin
                    prefix = p.item.prefix
                    cur = t.entry_raw(key)
                    if cur is not None:
                        old = (replace or {}).get(key)
                        e_cur = Entry.unpack(cur)
                        if old is None or _encoding(e_cur) != _encoding(old):
                            # stored, or re-encoded or moved to another tier meanwhile by another
                            # writer: ours is dead space. (Compaction moving the same record to
                            # another segment changes nothing this rewrite relies on.)
                            if p.item.aliases and old is None:
                                t.add_aliases(key, p.item.aliases)  # the same record, found by more keys
                            continue
                        # a move or re-encoding: the same tokens, so the same aliases
                        prefix = t.unindex_entry(key, e_cur, keep_aliases=True) or prefix
                        created, last, hits = e_cur.created, e_cur.last_access, e_cur.hits
                        origin = origin_of(e_cur)  # a move or re-encoding keeps where the chunk came from
                    e = Entry(seg, off, p.rec_len, p.stored_len, len(p.raw), csum,
                              p.item.tokens, hits, p.codec, st.tid, created, last, p.layout,
                              0 if p.codec == 0 else (codec.level if level is None else level),
                              ORIGIN_LOCAL if origin is None else ORIGIN_REMOTE, 0 if origin is None else origin.writer)
                    t.index_entry(key, e, prefix)
                    if p.item.aliases:
                        t.add_aliases(key, p.item.aliases)
                    results[i] = True
                    payload += e.stored_len
                t.add("written_bytes", written)
                t.add("payload_bytes", payload)
                t.add("puts", sum(results))

            try:
                self.index.write(commit)
            except StoreError:
                self.space.release(st, plan)  # not indexed: give its space back (if the index can be written)
                raise
            if self._config().fsync:  # an acknowledged put survives a power cut that comes SYNC_SOON_S later
                self.index.sync_soon()
        remote = self.ladder.remote() if share and replace is None else None
        if remote is not None and remote.cfg.write == "always":  # the remote tier's write-through
            shared: list[Stored] = [(p.item.key, p.stored, len(p.raw), p.codec, 0 if p.codec == 0 else
                                     (codec.level if level is None else level), p.layout, p.item.tokens, csum)
                                    for i, p, _seg, _off, csum in done if results[i]]
            if shared:
                remote.push(shared, {p.item.key: p.item.aliases for i, p, _seg, _off, _c in done
                                     if results[i] and p.item.aliases})
        return results

    def _write_records(self, st: TierState, prepared: list[_Prepared],
                       plan: list[Slot | None]) -> tuple[list[tuple[int, _Prepared, int, int, int]], int]:
        """Write the records that got space, wait for all of them and sync; returns what was
        written (index, prepared item, segment, offset, checksum) and the bytes written.
        On any failure the batch's space is given back and the error raised."""
        written = 0
        todo = []
        failure: BaseException | None = None
        try:
            for i, p in enumerate(prepared):
                slot = plan[i]
                if slot is None:
                    continue
                seg, off, fd = slot
                meta = record_meta(p.item)
                # hashing this record overlaps the disk writes of the previous ones
                pw = st.io.start_write(fd, off, p.stored, functools.partial(
                    encode_trailer, p.item.key, p.codec, meta, p.stored_len, len(p.raw), created=p.created))
                todo.append((i, p, seg, off, pw))
        except BaseException as exc:
            failure = exc
        for *_rest, pw in todo:  # every write is waited for (its buffers must outlive it)
            try:
                written += pw.result()[0]
            except BaseException as exc:
                failure = failure or exc
        done = [(i, p, seg, off, pw.checksum) for i, p, seg, off, pw in todo]
        if failure is None and done and self._config().fsync:
            try:
                for fd in {s[2] for s in plan if s is not None}:
                    st.io.sync(fd)
            except OSError as exc:
                failure = exc
        if failure is not None:
            # nothing of this batch is indexed: give its reserved space back, so a full
            # disk never leaves phantom usage behind that would evict real chunks
            self.space.release(st, plan)
            self.space.close_retired(st)
            if isinstance(failure, OSError) and failure.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFullError(
                    f"the disk under tier {st.name} ({st.io.dir}) is full: {len(done) or len(todo)} chunk(s) "
                    "not stored; free space there or lower the tier's capacity") from None
            if is_read_only(failure):
                raise self._read_only(st, len(done) or len(todo)) from None
            if isinstance(failure, OSError):  # e.g. EIO from a sync as the disk turns read-only
                refused = self._index_refuses()
                if refused is not None:
                    raise refused from None
            raise failure
        self.space.close_retired(st)
        return done, written

    def _read_only(self, st: TierState, chunks: int) -> ReadOnlyError:
        """The error for a write that tier ``st``'s filesystem refused as read-only (the
        index's own, when it refuses too)."""
        return self._index_refuses() or ReadOnlyError(
            f"the filesystem under tier {st.name} ({st.io.dir}) is read-only: {chunks} chunk(s) not stored; "
            "remount it read-write")

    def _index_refuses(self) -> ReadOnlyError | None:
        """After a segment write failed: whether the index is on a read-only filesystem now.
        A probe write finds out (and the store turns read-only: ``Index.went_read_only``)."""
        try:
            self.index.write(lambda t: t.put("meta", META_WRITE_PROBE, b""))
        except ReadOnlyError as exc:
            return exc
        except StoreError:
            pass  # another trouble of the index: the segment's error is the one to report
        return None

    # -- making room: eviction, and where its victims go -------------------------------
    def spill_moves(self, tier: str) -> bool:
        """Whether chunks evicted from ``tier`` move to another local tier (keeping them)."""
        return self.ladder.local_below(tier) is not None

    def make_room(self, tier: str, incoming: int, trim: bool = False) -> int:
        """Evict until ``incoming`` more bytes fit in ``tier`` (``Evictor``); returns the
        chunks evicted. Where victims spill, the evictor decides (``choose``), they are moved
        here (the write path's own ``rewrite``, or a push to the remote tier), and the evictor
        drops what is still where it was (``finish``): the evictor never calls back."""
        if not self.ladder.spills():
            return self.evictor.make_room(tier, incoming, trim)
        room = self.evictor.choose(tier, incoming, trim, self.spill_moves(tier))
        if room is None:
            return 0
        if room.victims:
            try:
                self._spill(tier, room.ordered())
            except (StoreError, OSError) as exc:  # the next tier is full or failing: evict
                log.warning("could not move %d chunk(s) out of tier %s (%s); evicting them", len(room.victims),
                            tier, exc)
        return self.evictor.finish(room)

    def _spill(self, tier: str, victims: list[tuple[bytes, Entry]]) -> None:
        below = self.ladder.local_below(tier)
        if below is not None:
            if self.admission.second_hit():  # only chunks that earned it; the evictor drops the rest
                admitted = self.admission.spill_admits(victims, self.reads.read_lately)
                dropped = [e for (_k, e), ok in zip(victims, admitted, strict=True) if not ok]
                if dropped:
                    m = self.reads.meter
                    m.inc("not_admitted_total", len(dropped), path="spill")
                    m.inc("not_admitted_bytes_total", sum(e.raw_len for e in dropped), path="spill")
                victims = [v for v, ok in zip(victims, admitted, strict=True) if ok]
            moved = self.rewrite([k for k, _e in victims], tier=below).chunks
            if moved:
                log.debug("demoted %d chunk(s) from %s to %s", moved, tier, below)
            return
        remote = self.ladder.remote()
        if remote is not None and remote.cfg.write == "evict":
            remote.push_entries(victims, self.reads.stored_bytes)

    # -- rewriting ---------------------------------------------------------------------
    def rewrite(self, keys: Sequence[bytes], tier: str | None = None, codec: str | None = None,
                level: int | None = None, progress: Callable[[int, int], None] | None = None,
                dry_run: bool = False) -> RewriteResult:
        """See ``Store.rewrite``."""
        if tier is not None:
            self.space.tier(tier)
        want_codec = None if codec is None else codec_id(codec)
        out = RewriteResult()
        total = len(keys)
        todo: list[tuple[bytes, Entry, int]] | None = [] if dry_run else None
        for n, key in enumerate(keys):
            if progress is not None:
                progress(n, total)
            what = self._rewrite_one(key, tier, want_codec, level, dry_run, out, todo)
            setattr(out, what, getattr(out, what) + 1)
        if todo is not None:
            out.bytes_after = self._estimate(todo, level)
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
            chunk = self.reads.get(key, touch=False)
            if chunk is None:
                continue
            itemsize = DTYPE_SIZES.get(chunk.layout.get("dtype", "uint8"), 1)
            data = memoryview(chunk.data).cast("B")
            before += e.stored_len
            after += len(memoryview(self._codec().encode(dst_codec, data, itemsize, level)))
        total_before = sum(e.stored_len for _k, e, _c in todo)
        return round(total_before * after / before) if before else total_before

    def _rewrite_one(self, key: bytes, tier: str | None, want_codec: int | None, level: int | None,
                     dry_run: bool, out: RewriteResult, estimate: list[tuple[bytes, Entry, int]] | None) -> str:
        """Rewrite one chunk; returns the ``RewriteResult`` field it counts in."""
        for _attempt in range(5):  # compaction may relocate the chunk under us: try again
            with self.index.read() as t:
                raw = t.entry_raw(key)
            if raw is None:
                return "missing"
            e = Entry.unpack(raw)
            dst_tier = tier or e.tier_name
            dst_codec = e.codec if want_codec is None else want_codec
            same_level = level is None or dst_codec == 0 or e.level == level
            if dst_tier == e.tier_name and dst_codec == e.codec and same_level:
                return "skipped"
            if dry_run:
                out.bytes_before += e.stored_len
                if estimate is not None:
                    estimate.append((key, e, dst_codec))
                return "chunks"
            chunk = self.reads.get(key, touch=False)
            if chunk is None:
                return "missing"
            item = PutItem(key, chunk.data, chunk.layout, chunk.tokens, CODEC_NAMES[dst_codec], origin=origin_of(e))
            if self.put_many([item], dst_tier, level=level, replace={key: e})[0]:
                new = self.reads.info(key)
                out.bytes_before += e.stored_len
                out.bytes_after += new.stored_bytes if new else 0
                return "chunks"
        return "skipped"


def record_meta(item: PutItem) -> dict[str, Any]:
    """What a record's trailer says of its chunk besides the key (JSON)."""
    meta: dict[str, Any] = {"layout": dict(item.layout), "tokens": item.tokens}
    if item.prefix:  # so that a rebuilt index knows it too
        meta["prefix"] = item.prefix.hex()
    if item.origin is not None:  # likewise
        meta["origin"] = {"tier": item.origin.tier, "writer": item.origin.writer}
    return meta


def _encoding(e: Entry) -> tuple[int, int, int, int, int]:
    """What a record holds, wherever it lies: a rewrite may replace an entry that compaction
    has since moved (same tier, codec, level and bytes), not one that was re-encoded."""
    return e.tier, e.codec, e.level, e.stored_len, e.checksum
