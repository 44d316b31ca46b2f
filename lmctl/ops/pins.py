"""``pin`` and ``unpin``, and ``export`` (the documents a label's pins were made from, for a manifest)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from store import Namespace, Store

from .. import pinned_documents
from ..errors import UsageError
from ..selection import arg, caller_uid, filters_of, labelled_keys, namespace_filter, recorded_namespaces, select
from ..short_keys import resolve_key
from .base import Job, names_of


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
        for entry, keys in pinned_entries(store, name, labels[name], where, names):
            add({**entry, "keys": [k.hex() for k in keys]} if "keys" in entry else entry)
            covered.update(keys)
        pinned += len(covered)
    if batch:
        job.emit(batch)
    return {"chunks": [], "pinned": pinned}


def pinned_entries(store: Store, name: str, pinned: list[bytes], where: Any,
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
        yield {**names_of(names.get(nid), name), "keys": None}, keys
