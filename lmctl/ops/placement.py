"""The operations that change where chunks are: ``evict``, ``move``, ``compress``, ``warm`` (with the
remote tier's fetches)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

from store import ChunkInfo, Counts, PutItem, RewriteResult, Store, StoreError
from store.config import TIER_ORDER

from ..errors import UsageError
from ..selection import arg, caller_uid, configured_tier, filters_of, select
from .base import MAX_LIMIT, Job, filter_scope

#: chunks evicted per index transaction
EVICT_BATCH = 256


def op_evict(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Evict what a selector picks. Filters are counted (a dry run reads only the index's
    counts) and streamed in key order, a batch per transaction: nothing holds the whole list.
    A dry run with ``list`` N also streams the first N chunks it would evict, as the rows of
    ``keys`` (``key``, ``tier``, ``bytes`` on disk, ``pins``)."""
    force = arg(args, "force", bool, False)
    dry_run = arg(args, "dry_run", bool, False)
    listing = arg(args, "list", int, 0) if dry_run else 0
    if not 0 <= listing <= MAX_LIMIT:
        raise UsageError(f"argument 'list' must be 0 (no listing) or a number of rows up to {MAX_LIMIT}")
    scope = filter_scope(store, args)
    counted: Counts | None = None
    if scope is None:
        keys = list(dict.fromkeys(select(store, args).keys))
        infos: Iterable[ChunkInfo] = (i for i in (store.info(k) for k in keys) if i is not None)
        total = len(keys)
    else:
        if not filters_of(args) and scope.only is None:
            select(store, args)  # no selector at all: the usage error that says how to choose
        infos = scope.stream(store)
        if scope.countable:
            counted = scope.count(store)
        total = counted.chunks if counted is not None else 0
    n = b = pinned_seen = listed = 0
    batch: list[ChunkInfo] = []

    def flush() -> None:
        nonlocal n, b, batch, listed
        if dry_run:
            n += len(batch)
            b += sum(i.disk_bytes for i in batch)
            shown = batch[: max(0, listing - listed)]
            if shown:  # what would go, streamed to the client as the listing "keys"
                job.emit([{"key": i.key.hex(), "tier": i.tier, "bytes": i.disk_bytes, "pins": i.pin_refs}
                          for i in shown], into="keys")
                listed += len(shown)
        else:
            got = store.evict([i.key for i in batch], force=force, uid=caller_uid())
            n += got.chunks
            b += got.bytes
        batch = []

    # a dry run of counted filters reads the counts, and the stream only for the rows it lists
    from_counts = dry_run and counted is not None
    for seen, info in enumerate(infos):
        if from_counts and listed >= listing:
            break
        if seen % EVICT_BATCH == 0:
            job.progress(seen, max(total, seen), "evicting")
        if info.pin_refs > 0:
            pinned_seen += 1
            if not force:
                continue
        batch.append(info)
        if len(batch) >= EVICT_BATCH:
            flush()
    if batch:
        flush()
    if from_counts:
        assert counted is not None
        victims = counted if force else counted.unpinned()
        n, b, pinned_seen = victims.chunks, victims.disk_bytes, counted.pinned_chunks
    job.progress(max(total, n), max(total, n), "evicting")
    out: dict[str, Any] = {"chunks": n, "bytes": b, "skipped_pinned": 0 if force else pinned_seen,
                           "pinned_removed": pinned_seen if force else 0, "dry_run": dry_run}
    if listing:
        out["keys"] = []  # the rows streamed (the client appends them here)
    return out


def _rewrite(store: Store, args: dict[str, Any], job: Job, what: str, **kw: Any) -> dict[str, Any]:
    sel = select(store, args)
    keys = list(dict.fromkeys(sel.keys))
    dry_run = arg(args, "dry_run", bool, False)
    res = store.rewrite(keys, progress=lambda d, t: job.progress(d, t, what), dry_run=dry_run, **kw)
    return {"chunks": res.chunks, "bytes": res.bytes_before, "bytes_before": res.bytes_before,
            "bytes_after": res.bytes_after, "skipped": res.skipped, "missing": res.missing, "dry_run": dry_run}


@dataclasses.dataclass
class Fit:
    """What of a selection a local tier can keep: ``take`` (the keys to bring in, in the
    selection's order), ``left`` (chunks ``--partial`` leaves where they are), ``room`` (the
    tier's room for the selection, bytes) and ``need`` (the selection's bytes there)."""

    take: list[bytes]
    left: int
    room: int
    need: int


def _fit(store: Store, keys: list[bytes], where: list[str | None], tier: str, partial: bool) -> Fit:
    """Check a selection against a local tier's room before anything moves: the tier keeps
    up to its low watermark of its capacity (eviction trims it down to that), less what its
    pinned chunks outside the selection hold. The selection's bytes are its chunks' bytes on
    disk, those already in the tier included (chunks only the remote tier holds have sizes
    known once fetched: they are not counted). Over the room, the move is refused with one
    line (it would evict part of what it brings in, or pinned chunks brought in before);
    with ``partial`` the chunks that fit are taken in order and the rest left."""
    from ..terminal import human

    cap = store.config.tiers[tier].capacity
    room = int(cap * store.config.low_watermark)
    sizes: list[int] = []
    pinned_in = 0
    for k, t in zip(keys, where, strict=True):
        info = store.info(k) if t not in (None, "remote") else None
        sizes.append(0 if info is None else info.disk_bytes)
        if info is not None and info.tier == tier and info.pin_refs > 0:
            pinned_in += info.disk_bytes
    pinned_other = max(0, store.stats().tiers[tier].pinned_bytes - pinned_in)
    room = max(0, room - pinned_other)
    need = sum(sizes)
    if need <= room:
        return Fit(keys, 0, room, need)
    if not partial:
        held = f", less {human(pinned_other)} of pinned chunks outside the selection" if pinned_other else ""
        raise StoreError(
            f"the selection ({human(need)} in {len(keys)} chunk(s)) exceeds {tier}'s room ({human(room)}: "
            f"{int(store.config.low_watermark * 100)}% of its {human(cap)} capacity{held}); bringing it in would "
            f"evict part of it again: select less, give {tier} more capacity (lmctl config set "
            f"tiers.{tier}.capacity=SIZE), or add --partial to bring in what fits, in order")
    take: list[bytes] = []
    used = 0
    for k, n in zip(keys, sizes, strict=True):  # a prefix: a document's first chunks are what hits
        if used + n > room:
            break
        used += n
        take.append(k)
    left = sum(1 for t in where[len(take):] if t is not None)
    return Fit(take, left, room, need)


def _in_tier(store: Store, keys: list[bytes], where: list[str | None], tier: str, dry_run: bool, fit: Fit) -> int:
    """How many chunks of the selection are in ``tier`` at the end (a dry run: how many would
    be, those it brings in and those there already)."""
    if dry_run:
        return sum(1 for t in where[:len(fit.take)] if t is not None)
    return sum(1 for t in store.locate(keys, remote=False) if t == tier)


def op_move(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    tier = configured_tier(store, arg(args, "to", str, ""), "--to")
    partial = arg(args, "partial", bool, False)
    if tier == "remote":
        if partial:
            raise UsageError("--partial goes with a local tier (--to dram or nvme): the remote tier's room is the "
                             "server's")
        out = _rewrite(store, args, job, f"moving to {tier}", tier=tier)
        out.update(to=tier, left=0, room=None, in_tier=None)  # the server's room is not known here
        return out
    keys = list(dict.fromkeys(select(store, args).keys))
    dry_run = arg(args, "dry_run", bool, False)
    where = store.locate(keys, remote=False)
    fit = _fit(store, keys, where, tier, partial)
    res = store.rewrite(fit.take, tier=tier, progress=lambda d, t: job.progress(d, t, f"moving to {tier}"),
                        dry_run=dry_run)
    return {"chunks": res.chunks, "bytes": res.bytes_before, "bytes_before": res.bytes_before,
            "bytes_after": res.bytes_after, "skipped": res.skipped, "missing": res.missing, "dry_run": dry_run,
            "to": tier, "left": fit.left, "room": fit.room, "in_tier": _in_tier(store, keys, where, tier, dry_run, fit)}


def op_compress(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    level = arg(args, "level", int, 1)
    codec = arg(args, "codec", str, "zstd-shuffle")
    if not 1 <= level <= 19:
        raise UsageError("--level must be between 1 and 19")
    if codec not in ("raw", "zstd", "zstd-shuffle"):
        raise UsageError("--codec must be raw, zstd or zstd-shuffle")
    out = _rewrite(store, args, job, "compressing", codec=codec, level=None if codec == "raw" else level)
    # negative when the chunks grew (e.g. --codec raw); a dry run's bytes_after is an estimate
    out["bytes_saved"] = out["bytes_before"] - out["bytes_after"]
    out["estimated"] = out["dry_run"]
    out["codec"], out["level"] = codec, None if codec == "raw" else level
    return out


def op_warm(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Bring the selected chunks (a label, a document) into a local tier (``to``: dram by
    default) from wherever they are: the other local tier (``Store.rewrite``) or the remote
    tier, read through the store (verified, then stored locally). ``chunks`` counts both,
    ``fetched`` those that came from the remote tier."""
    to = arg(args, "to", str, "dram")
    if to not in TIER_ORDER:
        raise UsageError(f"--to must be dram or nvme, not {to!r} (move --to remote puts chunks in the remote tier)")
    if to == "dram" and "dram" not in store.config.tiers:
        raise UsageError("tier dram is not configured in this store; nothing to promote "
                         "(pinned chunks stay on nvme and load from there)")
    configured_tier(store, to, "--to")
    dry_run = arg(args, "dry_run", bool, False)
    keys = list(dict.fromkeys(select(store, args).keys))
    # one round trip to the remote tier, for what the local tiers lack; what it did not answer
    # for is "unchecked", not "in no tier"
    where, unchecked = store.locate_checked(keys)
    fit = _fit(store, keys, where, to, arg(args, "partial", bool, False))
    taken = set(fit.take)
    local = [k for k, t in zip(keys, where, strict=True) if t not in (None, "remote") and k in taken]
    remote = [k for k, t in zip(keys, where, strict=True) if t == "remote" and k in taken]
    total = len(local) + len(remote)
    res = store.rewrite(local, tier=to, progress=lambda d, t: job.progress(d, total, f"warming into {to}"),
                        dry_run=dry_run)
    got, lost = _fetch(store, remote, to, dry_run,
                       lambda d: job.progress(len(local) + d, total, "fetching from remote"))
    return {"chunks": res.chunks + got.chunks, "bytes": res.bytes_before + got.bytes_before,
            "bytes_before": res.bytes_before + got.bytes_before, "bytes_after": res.bytes_after + got.bytes_after,
            "skipped": res.skipped + got.skipped,
            "missing": res.missing + where.count(None) - unchecked + got.missing, "unchecked": unchecked + lost,
            "dry_run": dry_run, "to": to, "fetched": got.chunks, "left": fit.left, "room": fit.room,
            "in_tier": _in_tier(store, keys, where, to, dry_run, fit)}


def _fetch(store: Store, keys: list[bytes], to: str, dry_run: bool,
           progress: Callable[[int], None]) -> tuple[RewriteResult, int]:
    """Bring chunks only the remote tier holds into the local tier ``to`` (``chunks``: those
    brought, with their stored bytes here; ``skipped``: read but left in another local tier,
    as ``Store.rewrite`` counts a chunk it could not place; ``missing``: gone from the server
    since they were located), and how many could not be read because the server stopped
    answering meanwhile (unchecked, not missing). A dry run reads nothing and counts every
    one as brought. A store read fetches and verifies a chunk and (with ``remote.promote``)
    stores it in the default tier, from where it is moved; without promotion it is stored here."""
    out = RewriteResult()
    if dry_run:
        out.chunks = len(keys)
        return out, 0
    elsewhere: list[bytes] = []
    lost: list[bytes] = []
    for n, key in enumerate(keys):
        progress(n)
        chunk = store.get(key)
        if chunk is not None and store.info(key) is None:
            store.put_many([PutItem(key, chunk.data, chunk.layout, chunk.tokens)], tier=to)
        info = store.info(key)
        if info is None:  # gone from the server, the server stopped answering, or no room here
            lost.append(key)
        elif info.tier != to:
            elsewhere.append(key)
        else:
            out.chunks += 1
            out.bytes_before += info.stored_bytes
            out.bytes_after += info.stored_bytes
    if elsewhere:
        r = store.rewrite(elsewhere, tier=to)
        out.chunks += r.chunks
        out.bytes_before += r.bytes_after  # what came from the server is what is stored here
        out.bytes_after += r.bytes_after
        out.skipped += r.skipped
        out.missing += r.missing
    unchecked = store.locate_checked(lost)[1] if lost else 0  # asked again: "not there", or no answer
    out.missing += len(lost) - unchecked
    progress(len(keys))
    return out, unchecked


#: entries of an export are streamed in frames of about this size (a frame holds at most 8 MiB)
