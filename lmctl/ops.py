"""The daemon's operations: each one a short adapter over a ``Store`` call.

Arguments arrive as the JSON ``args`` of a request (``lmctl/selection.py`` resolves their
selectors to chunk keys); results leave as JSON-ready dicts (numbers as numbers).
``UsageError`` means the request itself is wrong (exit code 2); any other ``StoreError``
means the operation failed (exit code 1).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from typing import Any

from store import ChunkInfo, Namespace, PutItem, RewriteResult, Store, StoreError, parse_key
from store.keys import short_key

from . import pinned_documents
from .errors import Cancelled, UsageError
from .selection import (
    Recorded,
    arg,
    caller_uid,
    check_conflicts,
    configured_tier,
    filter_chunks,
    filters_of,
    labelled_keys,
    namespace_filter,
    recorded_namespaces,
    select,
)

__all__ = ["OPS", "Cancelled", "Job", "UsageError", "select"]


class Job:
    """What an operation may tell its client while it runs. The daemon's job raises
    ``Cancelled`` from ``progress`` when the client went away or the daemon is stopping, so
    a long operation stops between two chunks (each chunk's change is atomic)."""

    def progress(self, done: int, total: int, what: str) -> None:
        return

    def emit(self, rows: list[dict[str, Any]]) -> None:
        """Stream part of a listing (``ls``); the client appends it to ``chunks``."""
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
    sel = select(store, {k: v for k, v in args.items() if k != "explain"})
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
        size: int | None = found.chunk_size
        namespace: dict[str, Any] | None = _ns_json(store, ns)
    else:
        # chunks by key or filter: taken as a chain in the order given (a document's keys)
        keys = list(dict.fromkeys(sel.keys))
        tiers = store.locate(keys)
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
    out = {
        "total_tokens": total, "hit_tokens": hit_tokens, "hit_chunks": hit, "chunk_size": size,
        "first_miss": hit_tokens if hit_tokens < total else None,
        "tiers": per_tier, "namespace": namespace,
        "chunks": [{"index": i, "key": k.hex(), "tier": t} for i, (k, t) in enumerate(zip(keys, tiers, strict=True))],
    }
    if explain:
        out["explain"] = why
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
    stored = sum(1 for t in store.locate(keys) if t is not None)
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


def op_evict(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    force = arg(args, "force", bool, False)
    dry_run = arg(args, "dry_run", bool, False)
    sel = select(store, args)
    infos = [i for i in (store.info(k) for k in dict.fromkeys(sel.keys)) if i is not None]
    pinned = [i for i in infos if i.pin_refs > 0]
    victims = infos if force else [i for i in infos if i.pin_refs == 0]
    out = {"chunks": len(victims), "bytes": sum(i.disk_bytes for i in victims),
           "skipped_pinned": 0 if force else len(pinned), "pinned_removed": len(pinned) if force else 0,
           "dry_run": dry_run}
    if dry_run:
        return out
    n = b = pinned_removed = 0
    total = len(victims)
    for start in range(0, total, 256):
        job.progress(start, total, "evicting")
        batch = victims[start : start + 256]
        got = store.evict([i.key for i in batch], force=force, uid=caller_uid())
        n += got.chunks
        b += got.bytes
        pinned_removed += sum(1 for i in batch if i.pin_refs > 0)
    job.progress(total, total, "evicting")
    out.update(chunks=n, bytes=b, pinned_removed=pinned_removed if force else 0)
    return out


def _rewrite(store: Store, args: dict[str, Any], job: Job, what: str, **kw: Any) -> dict[str, Any]:
    sel = select(store, args)
    keys = list(dict.fromkeys(sel.keys))
    dry_run = arg(args, "dry_run", bool, False)
    res = store.rewrite(keys, progress=lambda d, t: job.progress(d, t, what), dry_run=dry_run, **kw)
    return {"chunks": res.chunks, "bytes": res.bytes_before, "bytes_before": res.bytes_before,
            "bytes_after": res.bytes_after, "skipped": res.skipped, "missing": res.missing, "dry_run": dry_run}


def op_move(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    tier = configured_tier(store, arg(args, "to", str, ""), "--to")
    out = _rewrite(store, args, job, f"moving to {tier}", tier=tier)
    out["to"] = tier
    return out


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
    where = store.locate(keys)  # one round trip to the remote tier, for what the local tiers lack
    local = [k for k, t in zip(keys, where, strict=True) if t not in (None, "remote")]
    remote = [k for k, t in zip(keys, where, strict=True) if t == "remote"]
    total = len(local) + len(remote)
    res = store.rewrite(local, tier=to, progress=lambda d, t: job.progress(d, total, f"warming into {to}"),
                        dry_run=dry_run)
    got = _fetch(store, remote, to, dry_run, lambda d: job.progress(len(local) + d, total, "fetching from remote"))
    return {"chunks": res.chunks + got.chunks, "bytes": res.bytes_before + got.bytes_before,
            "bytes_before": res.bytes_before + got.bytes_before, "bytes_after": res.bytes_after + got.bytes_after,
            "skipped": res.skipped + got.skipped, "missing": res.missing + where.count(None) + got.missing,
            "dry_run": dry_run, "to": to, "fetched": got.chunks}


def _fetch(store: Store, keys: list[bytes], to: str, dry_run: bool, progress: Callable[[int], None]) -> RewriteResult:
    """Bring chunks only the remote tier holds into the local tier ``to`` (``chunks``: those
    brought, with their stored bytes here; ``skipped``: read but left in another local tier,
    as ``Store.rewrite`` counts a chunk it could not place; ``missing``: gone from the server
    since they were located). A dry run reads nothing and counts every one as brought. A
    store read fetches and verifies a chunk and (with ``remote.promote``) stores it in the
    default tier, from where it is moved; without promotion it is stored here."""
    out = RewriteResult()
    if dry_run:
        out.chunks = len(keys)
        return out
    elsewhere: list[bytes] = []
    for n, key in enumerate(keys):
        progress(n)
        chunk = store.get(key)
        if chunk is not None and store.info(key) is None:
            store.put_many([PutItem(key, chunk.data, chunk.layout, chunk.tokens)], tier=to)
        info = store.info(key)
        if info is None:  # gone from the server, or no room here: a miss
            out.missing += 1
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
    progress(len(keys))
    return out


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
        held = set(labels[name])
        left = dict.fromkeys(k for k in labels[name] if where is None or k[:16] in where.prefixes)
        covered: set[bytes] = set()
        for d in pinned_documents.documents(store.path, name):
            keys = [bytes.fromhex(h) for h in d["keys"]]
            if not keys or not held.issuperset(keys) or (
                    where is not None and not where.admits(d["model"], d["adapter"])):
                continue
            covered.update(keys)
            for k in keys:
                left.pop(k, None)
            entry: dict[str, Any] = {"label": name, "model": d["model"]}
            if d["adapter"] is not None:
                entry["adapter"] = d["adapter"]
            if d["salted"]:
                entry["needs_cache_salt"] = True
            add({**entry, **d["document"]})
        by_ns: dict[bytes, list[bytes]] = {}
        for k in left:
            by_ns.setdefault(k[:16], []).append(k)
        for nid, keys in by_ns.items():
            entry = {"label": name}
            ns = names.get(nid)
            if ns is not None:
                entry["model"] = ns.model
                if ns.adapter is not None:
                    entry["adapter"] = str(ns.adapter)
            add({**entry, "keys": [k.hex() for k in keys]})
        pinned += len(covered) + len(left)
    if batch:
        job.emit(batch)
    return {"chunks": [], "pinned": pinned}


def _info_json(c: ChunkInfo, names: dict[bytes, tuple[str, str | None]]) -> dict[str, Any]:
    model, adapter = names.get(c.key[:16], (None, None))
    return {"key": c.key.hex(), "tier": c.tier, "codec": c.codec, "level": c.level or None, "bytes": c.stored_bytes,
            "raw_bytes": c.raw_bytes, "disk_bytes": c.disk_bytes, "tokens": c.tokens, "hits": c.hits,
            "pins": c.pin_refs, "created": c.created, "last_access": c.last_access,
            "model": model, "adapter": adapter, "layout": c.layout}


def _names(store: Store) -> dict[bytes, tuple[str, str | None]]:
    return {r.nid: (r.ns.model, None if r.ns.adapter is None else str(r.ns.adapter))
            for r in recorded_namespaces(store)}


LS_BATCH = 1000


def op_ls(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Rows are streamed to the client in batches (``job.emit``), so a listing of any size
    fits the protocol's frame limit; the reply carries the totals."""
    limit = arg(args, "limit", int, 100)
    if limit < 0:
        raise UsageError("--limit must be 0 (all) or a positive number of rows")
    infos: Iterable[ChunkInfo]
    check_conflicts(args)
    if args.get("doc") is not None or (args.get("keys") and not filters_of(args)):
        infos = (i for i in (store.info(k) for k in select(store, args).keys) if i is not None)
    elif filters_of(args):
        infos = filter_chunks(store, args, select(store, {"keys": args["keys"]}).keys if args.get("keys") else None)
    else:
        infos = store.iter_chunks()
    names = _names(store)
    batch: list[dict[str, Any]] = []
    total = nbytes = shown = 0
    for c in infos:
        total += 1
        nbytes += c.stored_bytes
        if limit == 0 or shown < limit:
            batch.append(_info_json(c, names))
            shown += 1
            if len(batch) >= LS_BATCH:
                job.emit(batch)
                batch = []
        if total % 4096 == 0:
            job.progress(total, 0, "listing")
    if batch:
        job.emit(batch)
    return {"chunks": [], "total": total, "bytes": nbytes, "truncated": total > shown}


def op_inspect(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    key = arg(args, "key", str)
    if key is not None:
        try:
            k = parse_key(key)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
        info = store.info(k)
        if info is None:
            raise StoreError(f"no chunk {short_key(k)}… ({key}) in this store")
        out = _info_json(info, _names(store))
        out["labels"] = sorted(label for label, ks in store.labels().items() if k in set(ks))
        return {"chunk": out}
    st = store.stats()
    recorded = recorded_namespaces(store)
    retired = store.retired_namespaces()
    adapters: dict[str, dict[str, Any]] = {}
    models: dict[tuple[str, str | None], dict[str, Any]] = {}
    for r in recorded:
        n = b = 0
        for c in store.iter_chunks(r.nid):
            n += 1
            b += c.stored_bytes
        ns = r.ns
        name = "(base)" if ns.adapter is None else str(ns.adapter)
        a = adapters.setdefault(name, {"adapter": None if ns.adapter is None else str(ns.adapter),
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
        m["retired"] = m["retired"] and r.nid in retired
    labels = {label: len(ks) for label, ks in sorted(store.labels().items())}
    tiers = {name: {"chunks": t.chunks, "bytes": t.bytes, "capacity": t.capacity,
                    "disk_bytes": t.disk_bytes, "dead_bytes": t.dead_bytes, "segments": t.segments,
                    "pinned_bytes": t.pinned_bytes, "pin_budget": t.pin_budget}
             for name, t in st.tiers.items()}
    return {
        "chunks": sum(t["chunks"] for t in tiers.values()), "bytes": sum(t["bytes"] for t in tiers.values()),
        "tiers": tiers, "adapters": sorted(adapters.values(), key=lambda a: (a["model"], a["adapter"] or "")),
        "models": sorted(models.values(), key=lambda m: (m["model"], -m["last_used"])), "labels": labels,
        "counters": st.counters, "write_amplification": round(st.write_amplification, 6),
    }


def op_verify(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    deep = arg(args, "deep", bool, False)
    fix = arg(args, "fix", bool, False)
    problems = store.check(fix=fix, deep=deep, progress=lambda d, t: job.progress(d, t, "verifying"))
    return {"ok": not problems or all(p.fixed for p in problems), "deep": deep, "fixed": fix,
            "problems": [{"kind": p.kind, "detail": p.detail, "fixed": p.fixed} for p in problems]}


def op_events(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """The store's event log: the newest ``limit`` events (0: all) of the last ``since``
    seconds, of the ``kind`` list; and the totals by kind and reason, which outlive the log."""
    since = arg(args, "since", float)
    kinds = arg(args, "kind", list)
    limit = arg(args, "limit", int, 50)
    if since is not None and since < 0:
        raise UsageError("--since must not be negative")
    if limit < 0:
        raise UsageError("--limit must be 0 (all) or a positive number of events")
    if kinds is not None and not all(isinstance(k, str) for k in kinds):
        raise UsageError("argument 'kind' must be a list of event kinds")
    try:
        events = store.events(None if since is None else time.time() - since, kinds or None, limit)
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    return {"events": events, "counters": store.event_counters(), "limit": store.config.event_log_max}


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
            raise UsageError(f"tier {name} holds {pinned} pinned bytes, over the pin budget of "
                             f"{t.pin_budget_bytes} bytes these settings give; unpin first or give a larger "
                             "capacity or pin budget")


def op_config(store: Store, args: dict[str, Any], job: Job) -> dict[str, Any]:
    """Show the store's settings, or change some (``set``: {KEY: VALUE}), validated first."""
    from .settings import apply_settings, settings_json

    changes = arg(args, "set", dict, {})
    if changes:
        try:
            cfg = apply_settings(store.config, changes)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
        check_pin_budgets(store, cfg)
        store.configure(cfg)
    return {"settings": settings_json(store.config), "changed": sorted(changes)}


OPS: dict[str, Callable[[Store, dict[str, Any], Job], dict[str, Any]]] = {
    "lookup": op_lookup, "pin": op_pin, "unpin": op_unpin, "evict": op_evict, "move": op_move,
    "compress": op_compress, "warm": op_warm, "export": op_export, "ls": op_ls, "inspect": op_inspect,
    "verify": op_verify, "names": op_names, "config": op_config, "events": op_events,
}
