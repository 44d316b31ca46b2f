"""The daemon's operations: each one a short adapter over a ``Store`` call.

Arguments arrive as the JSON ``args`` of a request; results leave as JSON-ready dicts
(numbers as numbers). ``UsageError`` means the request itself is wrong (exit code 2);
any other ``StoreError`` means the operation failed (exit code 1).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from store import (
    AdapterIdentity,
    ChunkInfo,
    Namespace,
    NamespaceRecord,
    Store,
    StoreError,
    adapter_digest,
    parse_key,
)

Progress = Callable[[int, int, str], None]


class UsageError(StoreError):
    """The request is malformed: wrong argument types, unknown names, missing selectors."""


def _arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    v = args.get(name, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, float)):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise UsageError(f"argument {name!r} must be {want}, got {type(v).__name__}")
    return v


# -- selectors --------------------------------------------------------------------------
@dataclass
class Selection:
    """Chunks picked by a selector: keys in order, plus the namespaces a document used."""

    keys: list[bytes]
    namespaces: list[Namespace]
    token_ids: list[int] | None = None   # the document's tokens (None without a document)


def _namespaces(store: Store) -> list[tuple[NamespaceRecord, dict[str, Any]]]:
    """The recorded namespaces. A record keeps only a keyed digest of its salt, so it names
    its chunks' prefix (``ns_id``) but computes keys only given the salt."""
    return list(store.namespace_records().values())


def _resolve_adapter(spec: str, recorded: list[tuple[NamespaceRecord, dict[str, Any]]]) -> AdapterIdentity:
    if "@" in spec and os.path.sep not in spec:
        return AdapterIdentity.parse(spec)
    if os.path.isdir(spec):
        path = os.path.abspath(spec)
        digest = adapter_digest(path)
        for ns, _doc in recorded:
            if ns.adapter is not None and ns.adapter.digest == digest:
                return ns.adapter
        return AdapterIdentity(os.path.basename(path.rstrip(os.sep)), digest)
    best: tuple[float, AdapterIdentity] | None = None
    for ns, doc in recorded:
        if ns.adapter is not None and ns.adapter.name == spec:
            t = float(doc.get("updated", 0))
            if best is None or t > best[0]:
                best = (t, ns.adapter)
    if best is None:
        raise UsageError(f"no adapter named {spec!r} has been served from this store; "
                         f"give NAME@DIGEST or the adapter's folder")
    return best[1]


def _model_matches(ns: NamespaceRecord, doc: dict[str, Any], model: str | None) -> bool:
    return model is None or ns.model == model or doc.get("info", {}).get("model_id") == model


def _doc_namespaces(store: Store, args: dict[str, Any]) -> tuple[list[Namespace], dict[str, Any]]:
    """Namespaces a document's keys are computed in: one per KV format recorded for the
    model (tensor-parallel ranks), with the requested adapter and the operator's salt
    (records keep only its digest)."""
    recorded = _namespaces(store)
    model = _arg(args, "model", str)
    if model is None:
        models = sorted({ns.model for ns, _ in recorded})
        if len(models) != 1:
            raise UsageError("give --model: this store holds " + (
                f"{len(models)} models ({', '.join(models)})" if models else "no model yet"))
        model = models[0]
    mine = [(ns, doc) for ns, doc in recorded if _model_matches(ns, doc, model)]
    if not mine:
        raise StoreError(f"no engine has recorded model {model!r} in this store yet; serve one request "
                         "with it first (the engine hook records its KV format and tokenizer)")
    adapter_spec = _arg(args, "adapter", str)
    adapter = None if adapter_spec is None or _arg(args, "base", bool, False) else _resolve_adapter(
        adapter_spec, mine)
    salt = _arg(args, "salt", str)
    formats: dict[str, Namespace] = {}
    info: dict[str, Any] = {}
    for ns, doc in sorted(mine, key=lambda x: -float(x[1].get("updated", 0))):
        cand = Namespace(ns.model, ns.kv_format, adapter, salt or None, ns.model_fingerprint)
        k = json.dumps(cand.kv_format.__dict__, sort_keys=True) + str(ns.model_fingerprint)
        if k not in formats:
            formats[k] = cand
            info = info or doc.get("info", {})
    nss = sorted(formats.values(), key=lambda n: n.kv_format.tp_rank)
    return nss, info


FILTER_KEYS = ("model", "adapter", "base", "label", "tier", "older_than", "pinned")


def _filters(args: dict[str, Any]) -> set[str]:
    """The chunk filters a request sets (explicit keys and documents aside)."""
    return {k for k in FILTER_KEYS if args.get(k) not in (None, False)}


def select(store: Store, args: dict[str, Any], *, need: bool = True) -> Selection:
    """Resolve the shared selectors (SPEC section 6) to chunk keys."""
    doc = _arg(args, "doc", dict)
    keys_hex = _arg(args, "keys", list, [])
    try:
        explicit = [parse_key(str(k)) for k in keys_hex]
    except StoreError as exc:
        raise UsageError(str(exc)) from None
    if doc is not None:
        from .documents import tokenize

        nss, info = _doc_namespaces(store, args)
        source = _arg(args, "tokenizer", str) or info.get("tokenizer")
        if not source and "tokens" not in doc:
            raise StoreError("no tokenizer recorded for this model; pass --tokenizer PATH or --tokens FILE")
        tokens = tokenize(doc, source or "", info.get("tokenizer_revision"))
        keys = []
        for ns in nss:
            keys.extend(ns.chunk_keys(tokens))
        return Selection(explicit + keys, nss, tokens)
    filters = _filters(args)
    if not filters and not explicit:
        if need:
            raise UsageError("select chunks with --key, --label, --model, --adapter, --base, --tier, "
                             "--older-than, --pinned/--unpinned or a document (--text, --file, --tokens, --messages)")
        filters = set()
    if explicit and not filters:
        return Selection(explicit, [])
    return Selection([c.key for c in _filter(store, args, explicit or None)], [])


def _filter(store: Store, args: dict[str, Any], only: list[bytes] | None) -> Iterable[ChunkInfo]:
    recorded = _namespaces(store)
    model = _arg(args, "model", str)
    adapter_spec = _arg(args, "adapter", str)
    base = _arg(args, "base", bool, False)
    label = _arg(args, "label", str)
    tier = _arg(args, "tier", str)
    older = _arg(args, "older_than", float)
    pinned = args.get("pinned")
    if pinned is not None and not isinstance(pinned, bool):
        raise UsageError("argument 'pinned' must be true, false or absent")
    if tier is not None and tier not in store.stats()["tiers"]:
        raise UsageError(f"tier {tier!r} is not configured in this store")
    prefixes: list[bytes] | None = None
    if model is not None or adapter_spec is not None or base:
        adapter = _resolve_adapter(adapter_spec, recorded) if adapter_spec else None
        prefixes = [ns.ns_id for ns, doc in recorded if _model_matches(ns, doc, model)
                    and (not base or ns.adapter is None)
                    and (adapter is None or ns.adapter == adapter)]
    label_keys: set[bytes] | None = None
    if label is not None:
        labels = store.labels()
        if label not in labels:
            raise UsageError(f"no label {label!r} (labels: {', '.join(sorted(labels)) or 'none'})")
        label_keys = set(labels[label])
    cutoff = time.time() - older if older is not None else None

    def source() -> Iterable[ChunkInfo]:
        if only is not None:
            for k in only:
                info = store.info(k)
                if info is not None:
                    yield info
        elif label_keys is not None and prefixes is None:
            for k in sorted(label_keys):
                info = store.info(k)
                if info is not None:
                    yield info
        elif prefixes is not None:
            for p in prefixes:
                yield from store.iter_chunks(p)
        else:
            yield from store.iter_chunks()

    for c in source():
        if label_keys is not None and c.key not in label_keys:
            continue
        if tier is not None and c.tier != tier:
            continue
        if cutoff is not None and c.last_access > cutoff:
            continue
        if pinned is True and c.pin_refs == 0:
            continue
        if pinned is False and c.pin_refs > 0:
            continue
        yield c


# -- operations ---------------------------------------------------------------------------
def _ns_json(store: Store, ns: Namespace) -> dict[str, Any]:
    """A namespace for output: whether it is salted and the salt's keyed digest (as the
    store's records keep it), never the salt."""
    return {"model": ns.model, "adapter": None if ns.adapter is None else str(ns.adapter),
            "salted": ns.cache_salt is not None, "salt_digest": store.salt_digest(ns.cache_salt),
            "tp_rank": ns.kv_format.tp_rank, "chunk_size": ns.kv_format.chunk_size}


def op_lookup(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    sel = select(store, args)
    if not sel.namespaces:
        tiers = store.locate(sel.keys)
        chunks = [{"index": i, "key": k.hex(), "tier": t} for i, (k, t) in enumerate(zip(sel.keys, tiers, strict=True))]
        hit = sum(1 for t in tiers if t is not None)
        return {"total_tokens": 0, "hit_tokens": 0, "hit_chunks": hit, "chunks": chunks, "first_miss": None}
    ns = sel.namespaces[0]
    assert sel.token_ids is not None
    found = store.lookup(ns, sel.token_ids)
    per_tier: dict[str, int] = {}
    for t in found.tiers[: found.hit_chunks]:
        assert t is not None
        per_tier[t] = per_tier.get(t, 0) + 1
    return {
        "total_tokens": found.total_tokens, "hit_tokens": found.hit_tokens, "hit_chunks": found.hit_chunks,
        "chunk_size": found.chunk_size,
        "first_miss": found.hit_tokens if found.hit_tokens < found.total_tokens else None,
        "tiers": per_tier, "namespace": _ns_json(store, ns),
        "chunks": [{"index": i, "key": k.hex(), "tier": t}
                   for i, (k, t) in enumerate(zip(found.keys, found.tiers, strict=True))],
    }


def _label(args: dict[str, Any]) -> str:
    label = _arg(args, "label", str)
    if not label or "\0" in label or len(label) > 200:
        raise UsageError("--label NAME is required (1-200 characters)")
    return label


def op_pin(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    label = _label(args)
    sel = select(store, {k: v for k, v in args.items() if k != "label"})
    keys = list(dict.fromkeys(sel.keys))
    stored = sum(1 for t in store.locate(keys) if t is not None)
    if _arg(args, "dry_run", bool, False):
        have = set(store.labels().get(label, []))
        new = sum(1 for k in keys if k not in have)
        return {"label": label, "chunks": len(keys), "stored": stored, "added": new, "dry_run": True}
    expected = 0
    if sel.namespaces:
        expected = sel.namespaces[0].kv_format.chunk_bytes
    added = store.pin(label, keys, expected_bytes=expected)
    return {"label": label, "chunks": len(keys), "stored": stored, "added": added, "dry_run": False}


def op_unpin(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    label = _label(args)
    labels = store.labels()
    if label not in labels:
        raise StoreError(f"no label {label!r} (labels: {', '.join(sorted(labels)) or 'none'})")
    rest = {k: v for k, v in args.items() if k not in ("label", "dry_run")}
    has_sel = any(rest.get(k) not in (None, False, []) for k in rest)
    keys = None
    if has_sel:
        pinned = set(labels[label])
        keys = [k for k in dict.fromkeys(select(store, rest).keys) if k in pinned]
    target = len(labels[label]) if keys is None else len(keys)
    if _arg(args, "dry_run", bool, False):
        return {"label": label, "chunks": target, "removed": target, "dry_run": True}
    removed = store.unpin(label, keys)
    return {"label": label, "chunks": target, "removed": removed, "dry_run": False}


def op_evict(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    force = _arg(args, "force", bool, False)
    sel = select(store, args)
    infos = [i for i in (store.info(k) for k in dict.fromkeys(sel.keys)) if i is not None]
    pinned = [i for i in infos if i.pin_refs > 0]
    victims = infos if force else [i for i in infos if i.pin_refs == 0]
    if _arg(args, "dry_run", bool, False):
        return {"chunks": len(victims), "bytes": sum(i.disk_bytes for i in victims),
                "skipped_pinned": 0 if force else len(pinned), "dry_run": True}
    n = b = 0
    total = len(victims)
    for start in range(0, total, 256):
        progress(start, total, "evicting")
        got = store.evict([i.key for i in victims[start : start + 256]], force=force)
        n += got[0]
        b += got[1]
    progress(total, total, "evicting")
    return {"chunks": n, "bytes": b, "skipped_pinned": 0 if force else len(pinned), "dry_run": False}


def _rewrite(store: Store, args: dict[str, Any], progress: Progress, what: str, **kw: Any) -> dict[str, Any]:
    sel = select(store, args)
    keys = list(dict.fromkeys(sel.keys))
    res = store.rewrite(keys, progress=lambda d, t: progress(d, t, what),
                        dry_run=_arg(args, "dry_run", bool, False), **kw)
    return {"chunks": res["chunks"], "bytes": res["bytes_before"], "bytes_before": res["bytes_before"],
            "bytes_after": res["bytes_after"], "skipped": res["skipped"], "missing": res["missing"],
            "dry_run": bool(args.get("dry_run"))}


def _tier_arg(store: Store, args: dict[str, Any], name: str) -> str:
    tier = _arg(args, name, str)
    if tier not in ("dram", "nvme", "remote"):
        raise UsageError(f"--{name.replace('_', '-')} must be dram, nvme or remote")
    configured = store.stats()["tiers"]
    if tier not in configured:
        raise StoreError(f"tier {tier} is not configured in this store (configured: {', '.join(configured)}); "
                         "nothing was moved")
    return tier


def op_move(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    tier = _tier_arg(store, args, "to")
    out = _rewrite(store, args, progress, f"moving to {tier}", tier=tier)
    out["to"] = tier
    return out


def op_compress(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    level = _arg(args, "level", int, 1)
    codec = _arg(args, "codec", str, "zstd-shuffle")
    if not 1 <= level <= 19:
        raise UsageError("--level must be between 1 and 19")
    if codec not in ("raw", "zstd", "zstd-shuffle"):
        raise UsageError("--codec must be raw, zstd or zstd-shuffle")
    out = _rewrite(store, args, progress, "compressing", codec=codec, level=level)
    out["bytes_saved"] = max(0, out["bytes_before"] - out["bytes_after"]) if not out["dry_run"] else 0
    out["codec"], out["level"] = codec, level
    return out


def op_warm(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Promote the selected chunks (a label, typically) to the dram tier."""
    if "dram" not in store.stats()["tiers"]:
        raise StoreError("tier dram is not configured in this store; nothing to promote "
                         "(pinned chunks stay on nvme and load from there)")
    out = _rewrite(store, args, progress, "warming", tier="dram")
    out["to"] = "dram"
    return out


def _info_json(c: ChunkInfo, names: dict[bytes, tuple[str, str | None]]) -> dict[str, Any]:
    model, adapter = names.get(c.key[:16], (None, None))
    return {"key": c.key.hex(), "tier": c.tier, "codec": c.codec, "bytes": c.stored_bytes,
            "raw_bytes": c.raw_bytes, "disk_bytes": c.disk_bytes, "tokens": c.tokens, "hits": c.hits,
            "pins": c.pin_refs, "created": c.created, "last_access": c.last_access,
            "model": model, "adapter": adapter, "layout": c.layout}


def _names(store: Store) -> dict[bytes, tuple[str, str | None]]:
    return {ns.ns_id: (ns.model, None if ns.adapter is None else str(ns.adapter)) for ns, _ in _namespaces(store)}


def op_ls(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    limit = _arg(args, "limit", int, 100)
    infos: Iterable[ChunkInfo]
    if args.get("doc") is not None or (args.get("keys") and not _filters(args)):
        infos = (i for i in (store.info(k) for k in select(store, args).keys) if i is not None)
    elif _filters(args):
        infos = _filter(store, args, select(store, {"keys": args["keys"]}).keys if args.get("keys") else None)
    else:
        infos = store.iter_chunks()
    names = _names(store)
    rows: list[dict[str, Any]] = []
    total = nbytes = 0
    for c in infos:
        total += 1
        nbytes += c.stored_bytes
        if limit <= 0 or len(rows) < limit:
            rows.append(_info_json(c, names))
    return {"chunks": rows, "total": total, "bytes": nbytes, "truncated": total > len(rows)}


def op_inspect(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    key = _arg(args, "key", str)
    if key is not None:
        try:
            k = parse_key(key)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
        info = store.info(k)
        if info is None:
            raise StoreError(f"no chunk {key} in this store")
        out = _info_json(info, _names(store))
        out["labels"] = sorted(label for label, ks in store.labels().items() if k in set(ks))
        return {"chunk": out}
    st = store.stats()
    recorded = _namespaces(store)
    adapters: dict[str, dict[str, Any]] = {}
    models: dict[str, dict[str, Any]] = {}
    for ns, doc in recorded:
        n = b = 0
        for c in store.iter_chunks(ns.ns_id):
            n += 1
            b += c.stored_bytes
        name = "(base)" if ns.adapter is None else str(ns.adapter)
        a = adapters.setdefault(name, {"adapter": None if ns.adapter is None else str(ns.adapter),
                                       "name": None if ns.adapter is None else ns.adapter.name,
                                       "model": ns.model, "chunks": 0, "bytes": 0})
        a["chunks"] += n
        a["bytes"] += b
        m = models.setdefault(ns.model, {"model": ns.model, "chunks": 0, "bytes": 0,
                                         "tokenizer": doc.get("info", {}).get("tokenizer")})
        m["chunks"] += n
        m["bytes"] += b
    labels = {label: len(ks) for label, ks in sorted(store.labels().items())}
    tiers = {name: {"chunks": t["chunks"], "bytes": t["bytes"], "capacity": t["capacity"],
                    "disk_bytes": t["disk_bytes"], "dead_bytes": t["dead_bytes"], "segments": t["segments"],
                    "pinned_bytes": t["pinned_bytes"], "pin_budget": t["pin_budget"]}
             for name, t in st["tiers"].items()}
    return {
        "chunks": sum(t["chunks"] for t in tiers.values()), "bytes": sum(t["bytes"] for t in tiers.values()),
        "tiers": tiers, "adapters": sorted(adapters.values(), key=lambda a: (a["model"], a["adapter"] or "")),
        "models": sorted(models.values(), key=lambda m: m["model"]), "labels": labels,
        "counters": st["counters"], "write_amplification": round(st["write_amplification"], 6),
    }


def op_verify(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    deep = _arg(args, "deep", bool, False)
    fix = _arg(args, "fix", bool, False)
    problems = store.check(fix=fix, deep=deep, progress=lambda d, t: progress(d, t, "verifying"))
    return {"ok": not problems or all(p.fixed for p in problems), "deep": deep, "fixed": fix,
            "problems": [{"kind": p.kind, "detail": p.detail, "fixed": p.fixed} for p in problems]}


def op_names(store: Store, args: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Labels, adapters and models, for shell completion."""
    recorded = _namespaces(store)
    return {"labels": sorted(store.labels()),
            "adapters": sorted({str(ns.adapter) for ns, _ in recorded if ns.adapter is not None}
                               | {ns.adapter.name for ns, _ in recorded if ns.adapter is not None}),
            "models": sorted({ns.model for ns, _ in recorded})}


OPS: dict[str, Callable[[Store, dict[str, Any], Progress], dict[str, Any]]] = {
    "lookup": op_lookup, "pin": op_pin, "unpin": op_unpin, "evict": op_evict, "move": op_move,
    "compress": op_compress, "warm": op_warm, "ls": op_ls, "inspect": op_inspect, "verify": op_verify,
    "names": op_names,
}
