"""The daemon's operations: each one a short adapter over a ``Store`` call.

Arguments arrive as the JSON ``args`` of a request (``lmctl/selection.py`` resolves their
selectors to chunk keys); results leave as JSON-ready dicts (numbers as numbers).
``UsageError`` means the request itself is wrong (exit code 2); any other ``StoreError``
means the operation failed (exit code 1).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from typing import Any

from store import ChunkInfo, Counts, Namespace, PutItem, RewriteResult, Store, StoreError, parse_key
from store.config import human_size as human
from store.errors import TierNotEmpty
from store.keys import short_key

from . import pinned_documents
from .errors import Cancelled, Denied, UsageError
from .selection import (
    Recorded,
    Scope,
    arg,
    caller_is_owner,
    caller_uid,
    check_conflicts,
    configured_tier,
    filters_of,
    labelled_keys,
    namespace_filter,
    recorded_namespaces,
    scope_of,
    select,
)
from .short_keys import resolve_key

__all__ = ["OPS", "Cancelled", "Job", "UsageError", "select"]


class Job:
    """What an operation may tell its client while it runs. The daemon's job raises
    ``Cancelled`` from ``progress`` when the client went away or the daemon is stopping, so
    a long operation stops between two chunks (each chunk's change is atomic)."""

    def progress(self, done: int, total: int, what: str) -> None:
        return

    def emit(self, rows: list[dict[str, Any]], into: str = "chunks") -> None:
        """Stream part of a listing (``ls``, ``evict --dry-run``); the client appends it to the
        result's list ``into``."""
        raise NotImplementedError


# -- operations ---------------------------------------------------------------------------
def _ns_json(store: Store, ns: Namespace, rec: Recorded | None = None) -> dict[str, Any]:
    """A namespace for output: whether it is salted and the salt's keyed digest (as the
    store's records keep it), never the salt."""
    salted = ns.cache_salt is not None if rec is None else rec.salted
    digest = store.salt_digest(ns.cache_salt) if rec is None else rec.salt_digest
    return {"model": ns.model, "adapter": None if ns.adapter is None else str(ns.adapter),
            "salted": salted, "salt_digest": digest, "model_fingerprint": ns.model_fingerprint,
            "tp_rank": ns.kv_format.tp_rank, "chunk_size": ns.kv_format.chunk_size}


def op_lookup(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    explain = arg(args, "explain", bool, False)
    want_tokens = arg(args, "token_ids", bool, False)  # for lookup --router: the router hashes them itself
    given = filters_of(args)
    if args.get("doc") is None and given:
        # a filter picks chunks of many prompts (and of every namespace it admits): they make
        # no prefix, so a hit ratio of them would mean nothing
        flags = ", ".join("--" + ("unpinned" if f == "pinned" and args.get(f) is False else f.replace("_", "-"))
                          for f in sorted(given))
        raise UsageError(f"lookup answers for one prompt: give its document (--text, --file, --tokens or "
                         f"--messages) with {flags}; to count the chunks it picks per model and adapter, "
                         "run lmctl inspect with the same selectors")
    sel = select(store, {k: v for k, v in args.items() if k not in ("explain", "token_ids")})
    why: dict[str, Any] | None = None
    if explain and not sel.namespaces:
        raise UsageError("--explain needs a document (--text, --file, --tokens or --messages): the reason "
                         "is found from its tokens")
    if sel.namespaces:
        ns = sel.namespaces[0]
        assert sel.token_ids is not None
        found = store.lookup(ns, sel.token_ids)
        if explain:
            ex = store.explain(ns, sel.token_ids, found)
            why = None if ex is None else ex.to_dict()
        keys, tiers, total = found.keys, found.tiers, found.total_tokens
        partial = found.partial
        size: int | None = found.chunk_size
        namespace: dict[str, Any] | None = _ns_json(store, ns)
    else:
        # chunks by key or filter: taken as a chain in the order given (a document's keys)
        keys = list(dict.fromkeys(sel.keys))
        tiers = store.locate(keys)
        partial = None
        rec = {r.nid: r for r in recorded_namespaces(store)}
        first = rec.get(keys[0][:16]) if keys else None
        namespace = None if first is None else _ns_json(store, first.ns, first)
        size = first.ns.kv_format.chunk_size if first is not None else None
        if size is None:
            info = next((i for i in (store.info(k) for k in keys) if i is not None), None)
            size = info.tokens if info is not None else None
        total = len(keys) * size if size else 0
    hit = next((i for i, t in enumerate(tiers) if t is None), len(tiers))
    per_tier: dict[str, int] = {}
    for t in tiers[:hit]:
        assert t is not None
        per_tier[t] = per_tier.get(t, 0) + 1
    hit_tokens = hit * size if size else 0
    part: dict[str, Any] | None = None
    if partial is not None and partial.chunk == hit:  # the next chunk's leading blocks
        hit_tokens += partial.tokens
        part = {"chunk": partial.chunk, "tokens": partial.tokens, "tier": partial.tier, "key": partial.key.hex(),
                "record_tokens": partial.record_tokens, "via": "tail" if partial.alias is None else "alias"}
    out: dict[str, Any] = {
        "total_tokens": total, "hit_tokens": hit_tokens, "hit_chunks": hit, "chunk_size": size,
        "partial": part,
        "first_miss": hit_tokens if hit < len(keys) else None,  # null: every full chunk hits
        "tiers": per_tier, "namespace": namespace,
        "chunks": [{"index": i, "key": k.hex(), "tier": t} for i, (k, t) in enumerate(zip(keys, tiers, strict=True))],
    }
    if explain:
        out["explain"] = why
    if want_tokens:
        out["token_ids"] = sel.token_ids
    return out


def _label(args: dict[str, Any]) -> str:
    label = arg(args, "label", str)
    if not label or "\0" in label or len(label) > 200:
        raise UsageError("--label NAME is required (1-200 characters)")
    return label


def op_pin(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    label = _label(args)
    sel = select(store, {k: v for k, v in args.items() if k != "label"})
    keys = list(dict.fromkeys(sel.keys))
    where = store.locate(keys)
    stored = sum(1 for t in where if t is not None)
    if sel.namespaces and not keys:
        # a document shorter than one chunk has no chunk key: a pin would protect nothing
        n, size = len(sel.token_ids or []), sel.namespaces[0].kv_format.chunk_size
        raise UsageError(f"the document is {n} token(s), less than one chunk of {size}: nothing of it can be "
                         "pinned (partial chunks are never stored)")
    # a pin by key names a chunk that is stored (a whole key passes the selector as it is:
    # a typo would be a pin that never protects anything); a document may be pinned ahead
    explicit = {resolve_key(store, str(k)) for k in arg(args, "keys", list, [])}
    absent = [k for k, t in zip(keys, where, strict=True) if t is None and k in explicit]
    if absent:
        raise UsageError(f"chunk key {absent[0].hex()[32:48]}… (namespace {absent[0].hex()[:8]}…) is not stored"
                         + (f" (nor {len(absent) - 1} other key(s) given)" if len(absent) > 1 else "")
                         + ": a pin by --key needs a stored chunk (lmctl ls shows them); to pin chunks before "
                         "they are served, pin their document (--text, --file, --tokens or --messages)")
    if not keys:
        raise UsageError("nothing to pin: no stored chunk matches the selection")
    dry_run = arg(args, "dry_run", bool, False)
    expected = sel.namespaces[0].kv_format.chunk_bytes if sel.namespaces else 0
    # a dry run checks the pin budget as the real pin does, then changes nothing
    added = store.pin(label, keys, expected_bytes=expected, dry_run=dry_run, uid=caller_uid())
    if sel.namespaces and not dry_run:  # a document: kept for pin --export-manifest
        ns = sel.namespaces[0]
        doc = arg(args, "doc", dict)
        if "tokens" not in doc and arg(args, "tokenizer", str):
            doc = {"tokens": sel.token_ids}  # a tokenizer of this machine made them: the tokens travel
        pinned_documents.remember(store.path, label, ns.model, None if ns.adapter is None else str(ns.adapter),
                                  ns.cache_salt is not None, doc, keys)
    return {"label": label, "chunks": len(keys), "stored": stored, "added": added, "dry_run": dry_run}


def op_unpin(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    label = _label(args)
    pinned_keys = labelled_keys(store, label)
    rest = {k: v for k, v in args.items() if k not in ("label", "dry_run")}
    has_sel = any(rest.get(k) not in (None, False, []) for k in rest) or rest.get("pinned") is False
    keys = None
    if has_sel:
        pinned = set(pinned_keys)
        keys = [k for k in dict.fromkeys(select(store, rest).keys) if k in pinned]
    target = len(pinned_keys) if keys is None else len(keys)
    if arg(args, "dry_run", bool, False):
        return {"label": label, "chunks": target, "removed": target, "dry_run": True}
    removed = store.unpin(label, keys, uid=caller_uid())
    pinned_documents.prune(store.path, label, store.labels().get(label, []))
    return {"label": label, "chunks": target, "removed": removed, "dry_run": False}


def _evict_scope(store: Store, args: dict[str, Any]) -> Scope | None:
    """The scope of an evict or ls by filters (None: a document or explicit keys alone, which
    are resolved to their keys as given)."""
    check_conflicts(args)
    if args.get("doc") is not None or (args.get("keys") and not filters_of(args)):
        return None
    only = select(store, {"keys": args["keys"]}).keys if args.get("keys") else None
    return scope_of(store, args, only)


#: chunks evicted per index transaction
EVICT_BATCH = 256
#: the largest --limit a listing takes (0 means all)
MAX_LIMIT = 1 << 40


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
    scope = _evict_scope(store, args)
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
    from .terminal import human

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
    if to not in ("dram", "nvme"):
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
EXPORT_BATCH_BYTES = 1 << 20


def op_export(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """``pin --export-manifest``: the manifest entries of the pins the selector picks
    (``--label``, else every label; ``--model``, ``--adapter``, ``--base`` narrow them).
    A document recorded when it was pinned (``pinned_documents``) whose chunks are all still
    pinned under its label is one entry; the label's other pinned chunks are entries of
    chunk keys, one per namespace. Entries stream as listing rows do (the client collects
    them under ``chunks``); ``pinned`` counts the chunks they cover."""
    extra = sorted(filters_of(args) - {"label", "model", "adapter", "base"}) + [
        k for k in ("keys", "doc", "salt", "tokenizer") if args.get(k) is not None]
    if extra:
        raise UsageError(f"export takes label, model, adapter and base, not {', '.join(extra)}")
    label = arg(args, "label", str)
    labels = store.labels()
    if label is not None:
        labelled_keys(store, label)  # an unknown label is a usage error
    recorded = recorded_namespaces(store)
    where = namespace_filter(recorded, args)
    names = {r.nid: r.ns for r in recorded}
    batch: list[dict[str, Any]] = []
    size = pinned = 0

    def add(entry: dict[str, Any]) -> None:
        nonlocal batch, size
        batch.append(entry)
        size += len(json.dumps(entry))
        if size > EXPORT_BATCH_BYTES:
            job.emit(batch)
            batch, size = [], 0

    chosen = [label] if label is not None else sorted(labels)
    for n, name in enumerate(chosen):
        job.progress(n, len(chosen), "exporting")
        covered: set[bytes] = set()
        for entry, keys in _pinned_entries(store, name, labels[name], where, names):
            add({**entry, "keys": [k.hex() for k in keys]} if "keys" in entry else entry)
            covered.update(keys)
        pinned += len(covered)
    if batch:
        job.emit(batch)
    return {"chunks": [], "pinned": pinned}


def _pinned_entries(store: Store, name: str, pinned: list[bytes], where: Any,
                    names: dict[bytes, Namespace]) -> Iterator[tuple[dict[str, Any], list[bytes]]]:
    """The manifest entries of label ``name``'s pins (``pinned``: its keys; ``where``: a
    namespace filter or None), each with the chunk keys it covers: a document recorded when
    it was pinned whose chunks are all still pinned under the label, then one entry of chunk
    keys per namespace for the label's other chunks (its ``keys`` field is left for the
    caller to fill)."""
    held = set(pinned)
    left = dict.fromkeys(k for k in pinned if where is None or k[:16] in where.prefixes)
    for d in pinned_documents.documents(store.path, name):
        keys = [bytes.fromhex(h) for h in d["keys"]]
        if not keys or not held.issuperset(keys) or (
                where is not None and not where.admits(d["model"], d["adapter"])):
            continue
        for k in keys:
            left.pop(k, None)
        entry: dict[str, Any] = {"label": name, "model": d["model"]}
        if d["adapter"] is not None:
            entry["adapter"] = d["adapter"]
        if d["salted"]:
            entry["needs_cache_salt"] = True
        yield {**entry, **d["document"]}, list(dict.fromkeys(keys))
    by_ns: dict[bytes, list[bytes]] = {}
    for k in left:
        by_ns.setdefault(k[:16], []).append(k)
    for nid, keys in by_ns.items():
        yield {**_names_of(names.get(nid), name), "keys": None}, keys


def _names_of(ns: Namespace | None, label: str | None) -> dict[str, Any]:
    """The ``label``, ``model`` and ``adapter`` fields of a keys entry of manifest."""
    entry: dict[str, Any] = {} if label is None else {"label": label}
    if ns is not None:
        entry["model"] = ns.model
        if ns.adapter is not None:
            entry["adapter"] = str(ns.adapter)
    return entry


#: ``drain`` logs an event and streams what went every this many chunks copied, or this often
DRAIN_BATCH, DRAIN_FLUSH_S = 64, 1.0
#: why ``drain`` left a chunk behind; the first two are the operator's limits
DRAIN_REASONS = ("budget", "deadline", "refused", "unreadable", "gone")


def _hotness(c: ChunkInfo) -> tuple[bool, float, int]:
    """How ``drain`` orders chunks, hottest first: those hit since stored, most recently used
    first (then by hits), then those never hit, most recently used first."""
    return c.hits == 0, -c.last_access, -c.hits


@dataclasses.dataclass
class _Unit:
    """What ``drain`` copies as one: a pinned document (all its stored chunks, or nothing
    for the budget) or one chunk. ``row``: the report row of the pinned entry it is part of
    (None: an unpinned chunk); ``entry``: the manifest fields of a document (None: its chunks
    go as keys entries)."""

    keys: list[tuple[bytes, int]]  # each chunk's key and stored bytes
    row: dict[str, Any] | None
    entry: dict[str, Any] | None
    order: tuple[bool, float, int]


class _Drain:
    """The state of one ``drain``: what went, what did not and why, and the manifest entries
    not yet streamed to the client (they go, with an event, every ``DRAIN_BATCH`` chunks)."""

    def __init__(self, store: Store, job: Job, budget: int | None, deadline_s: float | None, dry_run: bool,
                 names: dict[bytes, Namespace], order: list[bytes], reader: Executor) -> None:
        self.store, self.job, self.budget, self.deadline_s, self.dry_run = store, job, budget, deadline_s, dry_run
        self.names, self.order, self.total = names, order, len(order)
        self.next_of = dict(zip(order, order[1:], strict=False))  # the chunk after each, in drain's order
        self.reader = reader
        self.ahead: tuple[bytes, Future[Any]] | None = None
        self.start = time.monotonic()
        self.stopped: str | None = None
        self.copied: set[bytes] = set()
        self.went = {"chunks": 0, "bytes": 0, "pinned_chunks": 0, "documents": 0}
        self.left = {r: {"chunks": 0, "bytes": 0, "pinned_chunks": 0} for r in DRAIN_REASONS}
        self.unlogged: list[bytes] = []
        self.unlogged_bytes = 0
        self.pending: list[dict[str, Any]] = []  # manifest entries not streamed yet
        self.keys_entry: dict[tuple[str | None, bytes], list[str]] = {}  # chunks that went, by label, namespace
        self.n = 0
        self.flushed = self.start

    def read(self, key: bytes) -> Any:
        """``Store.read_stored(key)``, read ahead while the chunk before was put; then the read
        of the chunk after it starts (the local read and the remote put overlap)."""
        ahead, self.ahead = self.ahead, None
        if ahead is not None and ahead[0] == key:
            got = ahead[1].result()
        else:
            if ahead is not None:
                ahead[1].result()  # a read for a chunk that does not go now: let it end
            got = self.store.read_stored(key)
        after = self.next_of.get(key)
        if after is not None:
            self.ahead = (after, self.reader.submit(self.store.read_stored, after))
        return got

    def out_of_time(self) -> bool:
        return self.deadline_s is not None and time.monotonic() - self.start >= self.deadline_s

    def leave(self, chunks: list[tuple[bytes, int]], reason: str, row: dict[str, Any] | None) -> None:
        for _k, size in chunks:
            self.left[reason]["chunks"] += 1
            self.left[reason]["bytes"] += size
            self.left[reason]["pinned_chunks"] += row is not None
        if row is not None and chunks:
            row["left"] += len(chunks)
            row["reason"] = row["reason"] or reason

    def run(self, u: _Unit) -> None:
        """Copy one unit, or leave it (the limits, checked before it starts)."""
        todo = [c for c in u.keys if c[0] not in self.copied]
        if u.row is not None:
            u.row["went"] += len(u.keys) - len(todo)  # copied already, under another label
        need = sum(size for _k, size in todo)
        if todo and self.stopped is None and self.out_of_time():
            self.stopped = "deadline"
        if todo and self.stopped is None and self.budget is not None and self.went["bytes"] + need > self.budget:
            self.stopped = "budget"  # in order: nothing colder goes while something hotter stayed
        if todo and self.stopped is not None:
            self.leave(todo, self.stopped, u.row)
            return
        went: list[bytes] = []
        for i, (key, size) in enumerate(todo):
            self.job.progress(self.n, self.total, "copying to the remote tier")  # where a cancel lands
            self.n += 1
            if self.out_of_time():  # a document that runs into the deadline goes in part
                self.stopped = "deadline"
                self.leave(todo[i:], "deadline", u.row)
                break
            what, n = ("copied", size) if self.dry_run else self.store.copy_to_remote(key, self.read(key))
            if what != "copied":
                self.leave([(key, size)], what, u.row)
                continue
            went.append(key)
            self.copied.add(key)
            self.went["chunks"] += 1
            self.went["bytes"] += n
            self.went["pinned_chunks"] += u.row is not None
            self.unlogged.append(key)
            self.unlogged_bytes += n
            if u.row is not None:
                u.row["went"] += 1
                u.row["bytes"] += n
        if u.entry is not None and u.keys and len(went) == len(todo):  # the document is whole there
            self.went["documents"] += 1
            self.pending.append(u.entry)
            self.flush()  # a frame per document (a document may be long)
            return
        label = None if u.row is None else u.row["label"]
        for k in went:
            self.keys_entry.setdefault((label, k[:16]), []).append(k.hex())
        if len(self.unlogged) >= DRAIN_BATCH or time.monotonic() - self.flushed >= DRAIN_FLUSH_S:
            self.flush()

    def entries(self) -> list[dict[str, Any]]:
        """The manifest entries to stream now: the documents that went, then keys entries."""
        out, self.pending = self.pending, []
        for (label, nid), keys in self.keys_entry.items():
            out.append({**_names_of(self.names.get(nid), label), "keys": keys})
        self.keys_entry = {}
        return out

    def log(self) -> None:
        """The event that says the chunks copied since the last one are in the remote tier."""
        if self.unlogged and not self.dry_run:
            self.store.log_remote_copies(self.unlogged, self.unlogged_bytes)
        self.unlogged, self.unlogged_bytes = [], 0

    def flush(self) -> None:
        self.flushed = time.monotonic()
        self.log()
        rows = self.entries()
        if rows:
            self.job.emit(rows, into="manifest")


def op_drain(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """``lmctl drain``: copy this store's chunks to the remote tier before the instance goes,
    pinned documents first, then by recent hits (``_hotness``), within ``budget`` (a size
    with a unit: stored bytes copied) and ``deadline_s``; the local copies stay. Manifest
    entries of what went stream to the client (``into: manifest``) as chunks go, each after
    its chunks are whole in the remote tier, so a client that stops part way holds a manifest
    of chunks that are all there. Returns the report (docs/cli.md, drain)."""
    from store.config import parse_unit_size

    budget = arg(args, "budget", str)
    limit = None
    if budget is not None:
        try:
            limit = parse_unit_size(budget, "--budget")
        except StoreError as exc:
            raise UsageError(str(exc)) from None
    deadline_s = arg(args, "deadline_s", float)
    if deadline_s is not None and not 0 < deadline_s <= 366 * 86400:
        raise UsageError("--deadline must be a duration between 1s and 366d")
    dry_run = arg(args, "dry_run", bool, False)
    if not store.has_remote:
        refused = store.stats().remote_refused
        raise UsageError("this store has no remote tier to drain to" + (
            f" (it did not start: {refused})" if refused else "") + "; configure one first: lmctl config set "
            "remote.url=redis://HOST:PORT remote.secret_file=FILE")
    recorded = recorded_namespaces(store)
    names = {r.nid: r.ns for r in recorded}

    # pinned entries first (a document whole, other pinned chunks one by one), hottest first
    rows: list[dict[str, Any]] = []
    units: list[_Unit] = []
    labels = store.labels()
    for name in sorted(labels):
        for entry, keys in _pinned_entries(store, name, labels[name], None, names):
            infos = [c for c in (store.info(k) for k in keys) if c is not None]
            chunks = [(c.key, c.stored_bytes) for c in infos]
            doc = "keys" not in entry
            row = {"label": name, "model": entry.get("model"), "adapter": entry.get("adapter"),
                   "document": next((k for k in ("text", "messages", "tokens") if k in entry), "keys"),
                   "chunks": len(infos), "not_stored": len(keys) - len(infos), "went": 0, "bytes": 0, "left": 0,
                   "reason": None}
            rows.append(row)
            if doc:
                units.append(_Unit(chunks, row, entry, min((_hotness(c) for c in infos), default=(True, 0.0, 0))))
            else:
                units.extend(_Unit([(c.key, c.stored_bytes)], row, None, _hotness(c)) for c in infos)
    units.sort(key=lambda u: u.order)
    # then every other chunk, hottest first (what a pin holds went above)
    cold = sorted((_hotness(c), c.key, c.stored_bytes) for c in store.iter_chunks() if c.pin_refs == 0)
    order = list(dict.fromkeys([k for u in units for k, _n in u.keys] + [k for _o, k, _n in cold]))
    total = len(order)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmctl-drain-read") as reader:
        d = _Drain(store, job, limit, deadline_s, dry_run, names, order, reader)
        try:
            for u in units:
                d.run(u)
            for hot, k, size in cold:
                d.run(_Unit([(k, size)], None, None, hot))
        finally:
            d.log()  # a cancelled drain too: what went is in the remote tier, and the log says so
    d.flush()
    job.progress(total, total, "copied to the remote tier")
    for r in rows:
        r["status"] = "went" if not r["left"] else "left" if not r["went"] else "partial"
    for i in range(0, len(rows), 1000):
        job.emit(rows[i:i + 1000], into="pinned")
    left_pinned = sum(1 for r in rows if r["left"] and r["reason"] != "gone")
    left = {"chunks": sum(x["chunks"] for x in d.left.values()), "bytes": sum(x["bytes"] for x in d.left.values()),
            "pinned_chunks": sum(x["pinned_chunks"] for x in d.left.values()),
            "reasons": {r: x for r, x in d.left.items() if x["chunks"]}}
    return {"dry_run": dry_run, "budget": limit, "deadline_s": deadline_s,
            "elapsed_s": round(time.monotonic() - d.start, 3), "stopped": d.stopped, "went": d.went, "left": left,
            "pinned_entries": len(rows), "pinned_left": left_pinned, "pinned": [], "manifest": []}


def _info_json(c: ChunkInfo, names: dict[bytes, tuple[str, str | None]]) -> dict[str, Any]:
    model, adapter = names.get(c.key[:16], (None, None))
    return {"key": c.key.hex(), "tier": c.tier, "codec": c.codec, "level": c.level or None, "bytes": c.stored_bytes,
            "raw_bytes": c.raw_bytes, "disk_bytes": c.disk_bytes, "tokens": c.tokens, "hits": c.hits,
            "pins": c.pin_refs, "created": c.created, "last_access": c.last_access,
            "model": model, "adapter": adapter, "layout": c.layout,
            "origin": None if c.origin is None else c.origin.to_dict()}


def _names(store: Store) -> dict[bytes, tuple[str, str | None]]:
    return {r.nid: (r.ns.model, None if r.ns.adapter is None else str(r.ns.adapter))
            for r in recorded_namespaces(store)}


LS_BATCH = 1000
#: ``ls --sort``: the order of each (a key of the row, smallest first) and its cursor's value
SORTS: dict[str, Callable[[ChunkInfo], tuple[Any, bytes]]] = {
    "key": lambda c: (0, c.key),
    "age": lambda c: (c.created, c.key),             # oldest first
    "access": lambda c: (c.last_access, c.key),      # least recently used first
    "size": lambda c: (-c.stored_bytes, c.key),      # largest first
}


def _cursor(sort: str, text: str | None) -> tuple[Any, bytes] | None:
    """A listing's ``--cursor`` (what ``next`` said) as the sort key of the last row shown."""
    if text is None:
        return None
    kind, _, rest = text.partition(":")
    value, _, key_hex = rest.rpartition(":")
    try:
        key = parse_key(key_hex)
        v: Any = 0 if kind == "key" else int(value) if kind == "size" else float(value)
        if kind != "key" and not (math.isfinite(v) and abs(v) < 1 << 62):
            raise ValueError(value)
    except (StoreError, ValueError):
        raise UsageError(f"--cursor {text!r} is not a cursor that ls printed (its 'next')") from None
    if kind != sort:
        raise UsageError(f"--cursor {text!r} continues a listing sorted by {kind}, not by {sort}: "
                         f"give --sort {kind}")
    return v, key


def _next(sort: str, c: ChunkInfo) -> str:
    v = SORTS[sort](c)[0]
    return f"{sort}:{'' if sort == 'key' else repr(v)}:{c.key.hex()}"


def op_ls(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """A page of the selected chunks (``limit`` rows; 0: all, in key order only) in ``sort``
    order, from ``cursor`` on; ``next`` is the cursor of the following page (None at the end).
    Rows stream to the client in batches (``job.emit``); totals come from the index's counts
    where the selector allows, else from the stream. Memory: a page, never the whole list
    (a sort other than by key keeps the page's rows in a bounded heap while it reads all)."""
    limit = arg(args, "limit", int, 100)
    sort = arg(args, "sort", str, "key")
    if not 0 <= limit <= MAX_LIMIT:
        raise UsageError(f"--limit must be 0 (all) or a number of rows up to {MAX_LIMIT}")
    if sort not in SORTS:
        raise UsageError(f"--sort must be one of {', '.join(SORTS)}, not {sort!r}")
    if limit == 0 and sort != "key":
        raise UsageError(f"--sort {sort} needs --limit N (rows per page; --cursor pages on)")
    after = _cursor(sort, arg(args, "cursor", str))
    scope = _evict_scope(store, args)
    sk = SORTS[sort]
    total = nbytes = 0
    counted = scope is not None and scope.countable
    if counted:
        assert scope is not None
        whole = scope.count(store)
        total, nbytes = whole.chunks, whole.bytes

    def selected() -> Iterator[ChunkInfo]:
        nonlocal total, nbytes
        if scope is None:
            source: Iterable[ChunkInfo] = (i for i in (store.info(k) for k in dict.fromkeys(select(store, args).keys))
                                           if i is not None)
        else:
            source = scope.stream(store, after[1] if after is not None and sort == "key" and scope.only is None
                                  else None)
        for n, i in enumerate(source):
            if not counted:
                total += 1
                nbytes += i.stored_bytes
            if n % 4096 == 4095:
                job.progress(n + 1, total if counted else 0, "listing")
            if after is None or sk(i) > after:
                yield i

    names = _names(store)
    rows = selected()
    page: Iterable[ChunkInfo]
    if sort == "key":
        page = rows if limit == 0 else itertools.islice(rows, limit + 1)
    else:
        page = heapq.nsmallest(limit + 1, rows, key=sk)  # a heap of limit + 1 rows
    batch: list[dict[str, Any]] = []
    shown = 0
    last: ChunkInfo | None = None
    more = False
    for c in page:
        if limit and shown >= limit:
            more = True
            break
        batch.append(_info_json(c, names))
        shown += 1
        last = c
        if len(batch) >= LS_BATCH:
            job.emit(batch)
            batch = []
    if batch:
        job.emit(batch)
    if not counted:
        for _ in rows:  # the rest of the selection, counted for the totals
            pass
    return {"chunks": [], "total": total, "bytes": nbytes, "truncated": more, "sort": sort,
            "next": _next(sort, last) if more and last is not None else None}


def op_inspect(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """One chunk's metadata (``key``, or one ``keys`` alone), or the store's statistics by
    tier, model, adapter and label, from the index's counts; with selectors, of the chunks
    they pick (``scope``) only."""
    key = arg(args, "key", str)
    keys = arg(args, "keys", list, [])
    sel = {k: v for k, v in args.items() if k != "key"}
    if key is None and len(keys) == 1 and not filters_of(sel) and sel.get("doc") is None:
        key = str(keys[0])
    if key is not None:
        k = resolve_key(store, key)
        info = store.info(k)
        if info is None:
            raise StoreError(f"no chunk {short_key(k)}… ({key}) in this store")
        row = _info_json(info, _names(store))
        row["labels"] = store.key_labels(k)
        return {"chunk": row}
    st = store.stats()
    counts = store.counts()
    scoped = bool(filters_of(sel) or keys or sel.get("doc") is not None)
    scope = None
    if scoped:
        scope = _evict_scope(store, sel)
        if scope is None:  # a document or explicit keys: their chunks, counted here
            scope = scope_of(store, {}, list(dict.fromkeys(select(store, sel).keys)))
        by_ns = scope.by_namespace(store)
    else:
        by_ns = counts.namespaces
    recorded = {r.nid: r for r in recorded_namespaces(store)}
    retired = store.retired_namespaces()
    adapters: dict[str, dict[str, Any]] = {}  # by model and adapter: two models' base chunks are two rows
    models: dict[tuple[str, str | None], dict[str, Any]] = {}
    for nid in recorded.keys() | by_ns.keys():
        n = b = 0
        for c in by_ns.get(nid, {}).values():
            n += c.chunks
            b += c.bytes
        r = recorded.get(nid)
        if r is None or (scoped and not n):
            continue  # chunks of a namespace never recorded are counted in the tiers only
        ns = r.ns
        name = "(base)" if ns.adapter is None else str(ns.adapter)
        a = adapters.setdefault(f"{ns.model}\0{name}", {"adapter": None if ns.adapter is None else str(ns.adapter),
                                       "name": None if ns.adapter is None else ns.adapter.name,
                                       "model": ns.model, "chunks": 0, "bytes": 0})
        a["chunks"] += n
        a["bytes"] += b
        m = models.setdefault((ns.model, ns.model_fingerprint), {
            "model": ns.model, "fingerprint": ns.model_fingerprint, "chunks": 0, "bytes": 0,
            "tokenizer": r.doc.get("info", {}).get("tokenizer"), "last_used": 0.0, "retired": True})
        m["chunks"] += n
        m["bytes"] += b
        m["last_used"] = max(m["last_used"], r.updated)
        m["retired"] = m["retired"] and nid in retired
    labels = dict(sorted(counts.label_keys.items()))
    tiers = {name: {"chunks": t.chunks, "bytes": t.bytes, "capacity": t.capacity,
                    "disk_bytes": t.disk_bytes, "dead_bytes": t.dead_bytes, "segments": t.segments,
                    "pinned_bytes": t.pinned_bytes, "pinned_chunks": t.pinned_chunks, "pin_budget": t.pin_budget}
             for name, t in st.tiers.items()}
    extra: dict[str, Any] = {}
    if scope is not None:
        # the selected chunks per tier (bytes on disk, as the store's tier rows count them)
        for name, t in tiers.items():
            c = Counts()
            for per_tier in by_ns.values():
                if name in per_tier:
                    c.add(per_tier[name])
            t.update(chunks=c.chunks, bytes=c.disk_bytes, pinned_bytes=c.pinned_disk_bytes,
                     pinned_chunks=c.pinned_chunks)
            for gone in ("disk_bytes", "dead_bytes", "segments"):
                t.pop(gone)
        # the labels' stored chunks within the selection (filters the counts answer)
        labels = {}
        if scope.pinned is False:
            pass  # unpinned chunks have no label
        elif scope.countable and scope.label is None:
            for label in counts.label_keys:
                n = dataclasses.replace(scope, label=label).count(store).chunks
                if n:
                    labels[label] = n
        else:  # read: a label's chunks (and the other labels that pin them too), --older-than, keys, a document
            for info in scope.stream(store):
                if info.pin_refs > 0:
                    for label in store.key_labels(info.key):
                        labels[label] = labels.get(label, 0) + 1
            labels = dict(sorted(labels.items()))
        extra["scope"] = {k: v for k, v in sel.items() if k != "doc"} | ({"doc": True} if "doc" in sel else {})
    return {
        "chunks": sum(t["chunks"] for t in tiers.values()), "bytes": sum(t["bytes"] for t in tiers.values()),
        "tiers": tiers, "adapters": sorted(adapters.values(), key=lambda a: (a["model"], a["adapter"] or "")),
        "models": sorted(models.values(), key=lambda m: (m["model"], -m["last_used"])), "labels": labels,
        "counters": st.counters, "write_amplification": round(st.write_amplification, 6), **extra,
    }


def op_verify(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    deep = arg(args, "deep", bool, False)
    fix = arg(args, "fix", bool, False)
    tiers = store.stats().tiers.values()  # what the pass covers, before a fix drops anything
    checked = {"chunks": sum(t.chunks for t in tiers), "segments": sum(t.segments for t in tiers)}
    problems = store.check(fix=fix, deep=deep, progress=lambda d, t: job.progress(d, t, "verifying"))
    return {"ok": not problems or all(p.fixed for p in problems), "deep": deep, "fixed": fix, "checked": checked,
            "problems": [{"kind": p.kind, "key": None if p.key is None else p.key.hex(), "detail": p.detail,
                          "fixed": p.fixed} for p in problems]}


def op_events(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """The store's event log: the newest ``limit`` events (0: all) of the last ``since``
    seconds, of the ``kind`` list, after event ``after`` (a ``seq``: ``events --follow`` asks
    for what came since its last call); the totals by kind and reason, which outlive the log;
    and ``last_seq``, the newest event's ``seq``, read before the events (so none falls between)."""
    since = arg(args, "since", float)
    kinds = arg(args, "kind", list)
    limit = arg(args, "limit", int, 50)
    after = arg(args, "after", int)
    last_seq = store.last_event_seq()
    if since is not None and since < 0:
        raise UsageError("--since must not be negative")
    if not 0 <= limit <= MAX_LIMIT:
        raise UsageError(f"--limit must be 0 (all) or a number of events up to {MAX_LIMIT}")
    if kinds is not None and not all(isinstance(k, str) for k in kinds):
        raise UsageError("argument 'kind' must be a list of event kinds")
    try:
        events = store.events(None if since is None else time.time() - since, kinds or None, limit, after)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    return {"events": events, "counters": store.event_counters(), "limit": store.config.event_log_max,
            "last_seq": max([last_seq, *(e.get("seq", 0) for e in events)])}


def op_names(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Labels, adapters and models, for shell completion."""
    recorded = recorded_namespaces(store)
    adapters = [r.ns.adapter for r in recorded if r.ns.adapter is not None]
    return {"labels": sorted(store.labels()),
            "adapters": sorted({str(a) for a in adapters} | {a.name for a in adapters}),
            "models": sorted({r.ns.model for r in recorded})}


def check_pin_budgets(store: Store, cfg: Any) -> None:
    """Refuse settings that would leave a tier's pinned chunks over its pin budget."""
    tiers = store.stats().tiers
    for name, t in cfg.tiers.items():
        pinned = tiers[name].pinned_bytes if name in tiers else 0
        if pinned > t.pin_budget_bytes:
            raise UsageError(f"tier {name} holds {human(pinned)} of pinned chunks, over the pin budget of "
                             f"{human(t.pin_budget_bytes)} these settings give; unpin first or give a larger "
                             "capacity or pin budget")


def op_config(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Show the store's settings, or change some (``set``: {KEY: VALUE}), validated first."""
    from .settings import apply_settings, owner_only, settings_json

    changes = arg(args, "set", dict, {})
    reserved = [] if caller_is_owner() else owner_only(changes)
    if reserved:
        uid = caller_uid()
        who = "a peer of unknown uid" if uid is None else f"uid {uid}"
        raise Denied(f"{who} may not change {', '.join(reserved)}: settings that make the daemon "
                     f"read a file or connect somewhere are for the store's owner (uid {os.geteuid()}) or root "
                     "to change; ask them, or run lmctl config set as that user")
    dry_run = arg(args, "dry_run", bool, False)
    if changes:
        try:
            cfg = apply_settings(store.config, changes)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
        check_pin_budgets(store, cfg)
        if dry_run:
            try:
                plan = store.eviction_plan(cfg)
            except StoreError as exc:
                raise UsageError(str(exc)) from None
            return {"settings": settings_json(cfg), "changed": sorted(changes), "dry_run": True,
                    "evicts": {name: {"chunks": len(victims), "bytes": sum(b for _k, b in victims), "moves_to": to,
                                      "capacity_before": store.config.tiers[name].capacity,
                                      "capacity": cfg.tiers[name].capacity}
                               for name, (victims, to) in plan.items()}}
        try:
            store.configure(cfg)
        except TierNotEmpty as exc:  # refused as a bad value is: nothing changed
            raise UsageError(str(exc)) from None
    elif dry_run:
        raise UsageError("--dry-run goes with config set KEY=VALUE...")
    # what the operator should know of the tiers just changed (a dram tier on disk, say)
    tiers = {str(k).split(".")[1] for k in changes if str(k).startswith("tiers.")}
    notes = [n for n in store.notes() if any(n.startswith(f"tier {t}'s ") for t in tiers)]
    return {"settings": settings_json(store.config), "changed": sorted(changes), "notes": notes}


OPS: dict[str, Callable[[Store, dict[str, Any], Job], dict[str, Any]]] = {
    "lookup": op_lookup, "pin": op_pin, "unpin": op_unpin, "evict": op_evict, "move": op_move,
    "compress": op_compress, "warm": op_warm, "export": op_export, "drain": op_drain, "ls": op_ls,
    "inspect": op_inspect, "verify": op_verify, "names": op_names, "config": op_config, "events": op_events,
}
