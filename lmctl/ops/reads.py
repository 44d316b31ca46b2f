"""The operations that read: ``lookup``, ``ls``, ``inspect``, ``events``, ``names``, and ``verify`` (which
changes the store only with ``fix``)."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from store import ChunkInfo, Counts, Namespace, Store, StoreError, parse_key
from store.format.keys import short_key

from ..errors import UsageError
from ..selection import Recorded, arg, filters_of, recorded_namespaces, scope_of, select
from ..short_keys import resolve_key
from .base import MAX_LIMIT, Job, filter_scope


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
    scope = filter_scope(store, args)
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
        scope = filter_scope(store, sel)
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
