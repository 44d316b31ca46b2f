"""The daemon's side of the shared selectors (SPEC section 6): a request's selector resolved
to chunk keys.

A selector names chunks by key, by filters (model, adapter, base, label, tier, age, pins)
or by a document, whose keys are computed in the namespaces the engine hook recorded for
the model. The CLI builds selectors (``lmctl/selectors.py``); the operations
(``lmctl/ops/``) act on what ``select`` resolves them to. Errors in a selector are
``UsageError``s.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from store import AdapterIdentity, ChunkInfo, Counts, Namespace, Store, StoreError, adapter_digest
from store.config import TIER_LADDER

from .errors import Denied, UsageError
from .short_keys import resolve_key


def arg(args: dict[str, Any], name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    """A request's argument ``name`` of type ``kind`` (``default`` when absent or null)."""
    v = args.get(name, default)
    if v is None:
        return default
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v = float(v)
    if not isinstance(v, kind) or (isinstance(v, bool) and kind in (int, float)):
        want = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise UsageError(f"argument {name!r} must be {want}, got {type(v).__name__}")
    if isinstance(v, float) and not math.isfinite(v):  # JSON as Python reads it has NaN and Infinity
        raise UsageError(f"argument {name!r} must be a finite number, not {v}")
    return v


@dataclass
class Selection:
    """Chunks picked by a selector: keys in order, plus the namespaces a document used."""

    keys: list[bytes]
    namespaces: list[Namespace]
    token_ids: list[int] | None = None   # the document's tokens (None without a document)


@dataclass
class Recorded:
    """A namespace as the engine hook recorded it. ``nid`` is the record's key (the chunk
    key prefix); ``ns`` is its namespace without the cache salt, which the store never
    keeps (``salted`` says whether it had one; ``salt_digest`` is the salt's keyed digest)."""

    nid: bytes
    ns: Namespace
    doc: dict[str, Any]
    salted: bool
    salt_digest: str | None = None

    @property
    def updated(self) -> float:
        return float(self.doc.get("updated", 0))


def recorded_namespaces(store: Store) -> list[Recorded]:
    """The recorded namespaces. A record keeps only a keyed digest of its salt, so it names
    its chunks' prefix (``nid``) but computes keys only given the salt."""
    return [Recorded(nid, rec.namespace(None), doc, rec.salted, rec.salt_digest)
            for nid, (rec, doc) in store.namespace_records().items()]


def _is_path(spec: str) -> bool:
    """An adapter spec is a folder only when it looks like a path: a name is a name."""
    return os.sep in spec or spec in (".", "..") or spec.startswith("~")


#: an adapter folder is hashed by the daemon only within these bounds
ADAPTER_MAX_ENTRIES = 2000
ADAPTER_MAX_BYTES = 16 << 30
_caller = threading.local()


def set_caller(uid: int | None) -> None:
    """The uid of the client whose request this thread serves (the daemon sets it)."""
    _caller.uid = uid


def caller_uid() -> int | None:
    """The uid of the client whose request this thread serves (None: not known)."""
    uid = getattr(_caller, "uid", None)
    return uid if isinstance(uid, int) and uid >= 0 else None


def caller_is_owner() -> bool:
    """Whether this thread's request is the store owner's (the daemon's user) or root's. A
    request of no known peer (a call in the daemon's own process) is the owner's; a peer whose
    credentials could not be read is not."""
    uid = getattr(_caller, "uid", None)
    return uid is None or uid in (0, os.geteuid())


def bounded_adapter_digest(path: str) -> str:
    """The digest of an adapter folder, hashed only if it looks like one (few files, bounded
    size: never a walk of /usr or /). It reads with this process's rights: the CLI hashes a
    folder its user names, and the daemon only folders its owner (or root) names."""
    entries = size = 0
    for dirpath, dirnames, filenames in os.walk(path):
        entries += len(dirnames) + len(filenames)
        if entries > ADAPTER_MAX_ENTRIES:
            raise UsageError(f"--adapter {path}: more than {ADAPTER_MAX_ENTRIES} files and folders; "
                             "that is not an adapter folder")
        for name in filenames:
            try:
                size += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
        if size > ADAPTER_MAX_BYTES:
            raise UsageError(f"--adapter {path}: over {ADAPTER_MAX_BYTES >> 30} GiB; that is not an adapter folder")
    try:
        return adapter_digest(path)
    except OSError as exc:
        raise UsageError(f"--adapter {path}: cannot read {exc.filename or path}: {exc.strerror}") from None
    except StoreError as exc:
        raise UsageError(f"--adapter: {exc}") from None


def _folder_digest(path: str, args: dict[str, Any]) -> str:
    """The digest of the adapter folder a request names: the one its client computed
    (``adapter_digest``), else, for the owner or root only, hashed here. The daemon never
    reads a folder for another uid: its own rights are not that peer's (a symlink there to a
    file in a folder the peer cannot enter would be read all the same)."""
    given = arg(args, "adapter_digest", str)
    if given is not None:
        if not re.fullmatch(r"[0-9a-f]{32}", given):
            raise UsageError("argument 'adapter_digest' must be an adapter digest (32 hex digits)")
        return given
    if not caller_is_owner():
        uid = caller_uid()
        raise Denied(f"--adapter {path}: the daemon reads no folder for {'a peer' if uid is None else f'uid {uid}'} "
                     "(its rights are not the caller's); give NAME@DIGEST, or use an lmctl that hashes the "
                     "folder itself and sends its digest")
    if not os.path.isdir(path):
        raise UsageError(f"--adapter {path}: no such folder (give NAME, NAME@DIGEST or the adapter's folder)")
    return bounded_adapter_digest(path)


def _resolve_adapter(spec: str, recorded: list[Recorded], args: dict[str, Any]) -> AdapterIdentity:
    if _is_path(spec):
        path = os.path.abspath(os.path.expanduser(spec))
        digest = _folder_digest(path, args)
        for r in recorded:
            if r.ns.adapter is not None and r.ns.adapter.digest == digest:
                return r.ns.adapter
        return AdapterIdentity(os.path.basename(path.rstrip(os.sep)), digest)
    if "@" in spec:
        try:
            ident = AdapterIdentity.parse(spec)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
        if not any(r.ns.adapter == ident for r in recorded):
            known = sorted({str(r.ns.adapter) for r in recorded if r.ns.adapter is not None})
            raise UsageError(f"no adapter {spec} has been served from this store (adapters: "
                             f"{', '.join(known) or 'none'}); for one never served, give its folder")
        return ident
    best: tuple[float, AdapterIdentity] | None = None
    for r in recorded:
        if r.ns.adapter is not None and r.ns.adapter.name == spec:
            if best is None or r.updated > best[0]:
                best = (r.updated, r.ns.adapter)
    if best is None:
        known = sorted({r.ns.adapter.name for r in recorded if r.ns.adapter is not None})
        raise UsageError(f"no adapter named {spec!r} has been served from this store "
                         f"(adapters: {', '.join(known) or 'none'}); give NAME@DIGEST or the adapter's folder")
    return best[1]


def _model_matches(r: Recorded, model: str | None) -> bool:
    return model is None or r.ns.model == model or r.doc.get("info", {}).get("model_id") == model


def _known_models(recorded: list[Recorded]) -> str:
    return ", ".join(sorted({r.ns.model for r in recorded})) or "none yet"


def _check_model(recorded: list[Recorded], model: str | None) -> None:
    if model is not None and not any(_model_matches(r, model) for r in recorded):
        raise UsageError(f"no model {model!r} in this store (models: {_known_models(recorded)}); "
                         "an engine with the lmctl connector records its model when it starts")


def check_conflicts(args: dict[str, Any]) -> None:
    if args.get("base") and args.get("adapter") is not None:
        raise UsageError("--base and --adapter contradict each other: give one")
    if args.get("doc") is not None and args.get("keys"):
        raise UsageError("--key and a document (--text, --file, --tokens, --messages) contradict each other: "
                         "give one")


def _doc_namespaces(store: Store, args: dict[str, Any]) -> tuple[list[Namespace], dict[str, Any]]:
    """Namespaces a document's keys are computed in: one per KV format (tensor-parallel
    rank) and model fingerprint recorded for the model, with the requested adapter and salt;
    the newest fingerprint first."""
    recorded = recorded_namespaces(store)
    model = arg(args, "model", str)
    if model is None:
        models = sorted({r.ns.model for r in recorded})
        if len(models) != 1:
            raise UsageError("give --model: this store holds " + (
                f"{len(models)} models ({', '.join(models)})" if models else "no model yet"))
        model = models[0]
    _check_model(recorded, model)
    mine = [r for r in recorded if _model_matches(r, model)]
    adapter_spec = arg(args, "adapter", str)
    adapter = None if adapter_spec is None else _resolve_adapter(adapter_spec, mine, args)
    salt = arg(args, "salt", str)
    formats: dict[str, Namespace] = {}
    info: dict[str, Any] = {}
    # a retired fingerprint (an old checkpoint nobody serves any more) gets no new keys
    retired = store.retired_namespaces()
    live = [r for r in mine if r.nid not in retired] or mine
    for r in sorted(live, key=lambda x: -x.updated):
        cand = Namespace(r.ns.model, r.ns.kv_format, adapter, salt or None, r.ns.model_fingerprint)
        k = json.dumps(cand.kv_format.__dict__, sort_keys=True) + str(r.ns.model_fingerprint)
        if k not in formats:
            formats[k] = cand
            info = info or r.doc.get("info", {})
    newest_fp = next(iter(formats.values())).model_fingerprint
    nss = sorted(formats.values(), key=lambda n: (n.model_fingerprint != newest_fp, n.kv_format.tp_rank))
    return nss, info


FILTER_KEYS = ("model", "adapter", "base", "label", "tier", "older_than", "pinned")


def filters_of(args: dict[str, Any]) -> set[str]:
    """The chunk filters a request sets (explicit keys and documents aside). ``pinned``
    false (``--unpinned``) is a filter too."""
    return {k for k in FILTER_KEYS
            if (args.get(k) is not None if k in ("pinned", "older_than") else args.get(k) not in (None, False))}


def select(store: Store, args: dict[str, Any], *, need: bool = True) -> Selection:
    """Resolve the shared selectors (SPEC section 6) to chunk keys."""
    check_conflicts(args)
    doc = arg(args, "doc", dict)
    keys_hex = arg(args, "keys", list, [])
    explicit = [resolve_key(store, str(k)) for k in keys_hex]  # a short key: the one stored chunk it starts
    if doc is not None:
        from .documents import check_document, tokenize

        check_document(doc)
        nss, info = _doc_namespaces(store, args)
        chosen = arg(args, "tokenizer", str)
        if chosen and chosen != info.get("tokenizer") and not caller_is_owner():
            # loading one reads a folder or downloads, with the daemon's rights: the owner's call
            raise Denied(f"--tokenizer {chosen}: the daemon loads only the tokenizer the engine recorded for "
                         "another uid's requests; leave --tokenizer out, or give the document as token ids "
                         "(--tokens FILE)")
        source = chosen or info.get("tokenizer")
        if not source and "tokens" not in doc:
            raise UsageError("no tokenizer recorded for this model; pass --tokenizer PATH or --tokens FILE")
        tokens = tokenize(doc, source or "", info.get("tokenizer_revision"))
        keys = []
        for ns in nss:
            keys.extend(ns.chunk_keys(tokens))
        return Selection(explicit + keys, nss, tokens)
    filters = filters_of(args)
    if not filters and not explicit:
        if need:
            raise UsageError("select chunks with --key, --label, --model, --adapter, --base, --tier, "
                             "--older-than, --pinned/--unpinned or a document (--text, --file, --tokens, --messages)")
        filters = set()
    if explicit and not filters:
        return Selection(explicit, [])
    return Selection([c.key for c in filter_chunks(store, args, explicit or None)], [])


def labelled_keys(store: Store, label: str) -> list[bytes]:
    """The keys pinned under ``label``; an unknown label is a usage error naming the known ones."""
    labels = store.labels()
    if label not in labels:
        raise UsageError(f"no label {label!r} (labels: {', '.join(sorted(labels)) or 'none'})")
    return labels[label]


def configured_tier(store: Store, tier: str, what: str) -> str:
    """``tier`` (the value of option ``what``) when this store has it configured."""
    if tier not in TIER_LADDER:
        raise UsageError(f"{what} must be dram, nvme or remote, not {tier!r}")
    configured = list(store.config.tiers) + (["remote"] if store.config.remote is not None else [])
    if tier not in configured:
        raise UsageError(f"tier {tier} is not configured in this store (configured: {', '.join(configured)}); "
                         "add it with lmctl config set or the daemon's settings"
                         + (" (remote.url, or serve --remote URL)" if tier == "remote" else ""))
    return tier


@dataclass
class NamespaceFilter:
    """What ``--model``, ``--adapter`` and ``--base`` admit: the models (ids as recorded)
    and adapter identity, and the recorded namespaces (chunk key prefixes) that match."""

    models: set[str]
    adapter: AdapterIdentity | None
    base: bool
    prefixes: list[bytes]

    def admits(self, model: str, adapter: str | None) -> bool:
        """Whether a namespace of ``model`` and ``adapter`` (NAME@DIGEST or None) passes."""
        return (model in self.models and (not self.base or adapter is None)
                and (self.adapter is None or adapter == str(self.adapter)))


def namespace_filter(recorded: list[Recorded], args: dict[str, Any]) -> NamespaceFilter | None:
    """The namespace filter of ``args`` (None when it sets none); an unknown model or
    adapter is a usage error."""
    model = arg(args, "model", str)
    adapter_spec = arg(args, "adapter", str)
    base = arg(args, "base", bool, False)
    _check_model(recorded, model)
    if model is None and adapter_spec is None and not base:
        return None
    adapter = _resolve_adapter(adapter_spec, recorded, args) if adapter_spec else None
    mine = [r for r in recorded if _model_matches(r, model)]
    return NamespaceFilter({r.ns.model for r in mine}, adapter, base,
                           [r.nid for r in mine if (not base or r.ns.adapter is None)
                            and (adapter is None or r.ns.adapter == adapter)])


@dataclass
class Scope:
    """What a selector's filters pick, in a form that is counted from the index's counts
    (``countable``: namespaces, a label, a tier, pinned or not) or streamed in key order,
    a page at a time (never the whole list in memory)."""

    prefixes: list[bytes] | None  # namespace ids (None: every namespace)
    label: str | None
    tier: str | None
    pinned: bool | None
    cutoff: float | None  # last used before this time (``--older-than``)
    only: list[bytes] | None  # explicit keys (``--key``), in the order given

    @property
    def countable(self) -> bool:
        return self.cutoff is None and self.only is None

    def by_namespace(self, store: Store) -> dict[bytes, dict[str, Counts]]:
        """The selected chunks counted per namespace id and tier: from the index's counts when
        ``countable``, else by streaming the selection."""
        if not self.countable:
            out: dict[bytes, dict[str, Counts]] = {}
            for c in self.stream(store):
                pinned = c.pin_refs > 0
                out.setdefault(c.key[:16], {}).setdefault(c.tier, Counts()).add(Counts(
                    1, c.stored_bytes, c.disk_bytes, int(pinned), c.stored_bytes * pinned, c.disk_bytes * pinned))
            return out
        counts = store.counts()
        src = counts.namespaces if self.label is None else counts.labels.get(self.label, {})
        wanted = None if self.prefixes is None else set(self.prefixes)
        picked: dict[bytes, dict[str, Counts]] = {}
        for nid, tiers in src.items():
            if wanted is not None and nid not in wanted:
                continue
            for tier, kept in tiers.items():
                if self.tier is not None and tier != self.tier:
                    continue
                n = kept if self.pinned is None else kept.pinned() if self.pinned else kept.unpinned()
                if n.chunks:
                    picked.setdefault(nid, {})[tier] = n
        return picked

    def count(self, store: Store) -> Counts:
        out = Counts()
        for tiers in self.by_namespace(store).values():
            for c in tiers.values():
                out.add(c)
        return out

    def stream(self, store: Store, after: bytes | None = None) -> Iterator[ChunkInfo]:
        """The selected chunks in key order (explicit keys: in their order), after ``after``."""
        wanted = None if self.prefixes is None else set(self.prefixes)

        def source() -> Iterator[ChunkInfo]:
            if self.only is not None:
                for k in self.only:
                    info = store.info(k)
                    if info is not None:
                        yield info
            elif self.label is not None:
                for c in store.iter_labelled(self.label, after):
                    if wanted is None or c.key[:16] in wanted:
                        yield c
            elif self.prefixes is not None:
                for p in sorted(self.prefixes):
                    yield from store.iter_chunks(p, after)
            else:
                yield from store.iter_chunks(b"", after)

        label_keys = None
        if self.only is not None and self.label is not None:
            label_keys = set(labelled_keys(store, self.label))
        for c in source():
            if label_keys is not None and c.key not in label_keys:
                continue
            if wanted is not None and self.only is not None and c.key[:16] not in wanted:
                continue
            if self.tier is not None and c.tier != self.tier:
                continue
            if self.cutoff is not None and c.last_access > self.cutoff:
                continue
            if self.pinned is True and c.pin_refs == 0:
                continue
            if self.pinned is False and c.pin_refs > 0:
                continue
            yield c


def scope_of(store: Store, args: dict[str, Any], only: list[bytes] | None = None) -> Scope:
    """The ``Scope`` of ``args``' filters (of ``only``'s chunks, when given)."""
    recorded = recorded_namespaces(store)
    label = arg(args, "label", str)
    tier = arg(args, "tier", str)
    older = arg(args, "older_than", float)
    pinned = args.get("pinned")
    if pinned is not None and not isinstance(pinned, bool):
        raise UsageError("argument 'pinned' must be true, false or absent")
    if older is not None and older < 0:
        raise UsageError("--older-than must not be negative")
    if tier == "remote":
        # the local index holds local chunks only: what move --to remote put there left it
        raise UsageError("--tier remote selects nothing: this store's index lists only the chunks of its local "
                         "tiers (dram, nvme), not what the remote tier holds; find remote chunks by document "
                         "(--text, --file, --tokens, --messages), by whole key (--key, 96 digits) or with "
                         "warm --manifest")
    if tier is not None:
        configured_tier(store, tier, "--tier")
    if label is not None and label not in store.counts().label_keys:
        labelled_keys(store, label)  # an unknown label is a usage error naming the known ones
    where = namespace_filter(recorded, args)
    return Scope(None if where is None else where.prefixes, label, tier, pinned,
                 time.time() - older if older is not None else None, only)


def filter_chunks(store: Store, args: dict[str, Any], only: list[bytes] | None) -> Iterable[ChunkInfo]:
    """The stored chunks (of ``only``, when given) that every filter of ``args`` lets through."""
    return scope_of(store, args, only).stream(store)
