"""Namespace records: what operators and eviction know about each namespace.

A record names the model, KV format, adapter, model fingerprint and a keyed digest of
the cache salt (never the salt), plus facts an engine adds (tokenizer, model path) and
when an engine last used it. The salt key is made once per store and kept in the index.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

from ..clock import SYSTEM_CLOCK, Clock
from ..errors import StoreError
from ..format.keys import Namespace, NamespaceRecord
from ..format.private import SALT_KEY_BYTES, salt_digest
from ..index import Index, Txn
from ..index.schema import META_SALT_KEY

log = logging.getLogger("lmctl.store")


class Namespaces:
    """The ``namespaces`` sub-database and the store's salt key."""

    def __init__(self, index: Index, path: str, journal_add: Callable[..., None],
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.index = index
        self.clock = clock
        self.path = path
        self._journal_add = journal_add
        self.salt_key: bytes | None = None

    def load_salt_key(self, restored: str | None = None) -> None:
        """Read the store's secret key for salt digests, making it (in the index, 0600) when
        the store is first opened for writing. Records written before salts were kept as
        digests hold the salt itself: they are rewritten here, once."""
        if self.index.readonly:
            with self.index.read() as t:
                raw = t.get("meta", META_SALT_KEY)
            self.salt_key = None if raw is None else bytes(raw)
            return
        made: list[bytes] = []

        def fn(t: Txn) -> tuple[bytes, int]:
            raw = t.get("meta", META_SALT_KEY)
            if raw is not None:
                key = bytes(raw)
            else:
                key = bytes.fromhex(restored) if restored else os.urandom(SALT_KEY_BYTES)
                t.put("meta", META_SALT_KEY, key)
                made.append(key)
            legacy = []
            for k, v in t.rows("namespaces"):
                doc = json.loads(bytes(v))
                if "cache_salt" in doc.get("namespace", {}):
                    legacy.append((bytes(k), doc))
            for k, doc in legacy:
                salt = doc["namespace"].pop("cache_salt")
                doc["namespace"]["salt_digest"] = None if salt is None else salt_digest(key, salt)
                t.put("namespaces", k, json.dumps(doc, sort_keys=True).encode())
            return key, len(legacy)

        key, migrated = self.index.write(fn, durable=True)
        self.salt_key = key
        if made:
            self._journal_add("salt_key", key=key.hex())
        if migrated:
            log.warning("rewrote %d namespace records of store %s to keep keyed digests of cache salts "
                        "instead of the salts", migrated, self.path)

    def salt_digest(self, cache_salt: str | None) -> str | None:
        """The keyed digest that records keep instead of ``cache_salt`` (None: unsalted)."""
        if cache_salt is None:
            return None
        if self.salt_key is None:
            raise StoreError(f"store {self.path} has no salt key yet; open it for writing once")
        return salt_digest(self.salt_key, cache_salt)

    def register(self, ns: Namespace, info: dict[str, Any] | None = None) -> bytes:
        """Record ``ns`` (and facts such as the tokenizer source); see ``Store.register_namespace``."""
        doc: dict[str, Any] = {"namespace": ns.record(self.salt_digest(ns.cache_salt)), "info": info or {},
                               "updated": self.clock.time()}

        def fn(t: Txn) -> bool:
            old = t.get("namespaces", ns.ns_id)
            changed = old is None
            if old is not None:
                prev = json.loads(bytes(old))
                same = prev.get("info") == doc["info"] and prev.get("namespace") == doc["namespace"]
                # "updated" is also when an engine last used the namespace (engines record
                # theirs every few minutes): eviction retires fingerprints nobody uses
                if same and doc["updated"] - float(prev.get("updated", 0)) < 60:
                    return False
                doc["info"] = {**prev.get("info", {}), **doc["info"]}
                changed = doc["info"] != prev.get("info") or doc["namespace"] != prev.get("namespace")
            t.put("namespaces", ns.ns_id, json.dumps(doc, sort_keys=True).encode())
            return changed

        if self.index.write(fn, durable=True):
            self._journal_add("ns", id=ns.ns_id.hex(), doc=doc)
        return ns.ns_id

    def put_records(self, docs: dict[str, Any]) -> None:
        """Write records as they are (restoring them from the metadata journal)."""

        def fn(t: Txn) -> None:
            for nid, doc in docs.items():
                t.put("namespaces", bytes.fromhex(nid), json.dumps(doc, sort_keys=True).encode())

        self.index.write(fn)

    def all(self) -> dict[bytes, dict[str, Any]]:
        with self.index.read() as t:
            return {bytes(k): json.loads(bytes(v)) for k, v in t.rows("namespaces")}

    def parsed(self) -> dict[bytes, tuple[NamespaceRecord, dict[str, Any]]]:
        out = {}
        for nid, doc in self.all().items():
            try:
                out[nid] = (NamespaceRecord.from_record(nid, doc["namespace"]), doc)
            except (KeyError, TypeError, ValueError, StoreError):
                continue
        return out

    def retired(self, t: Txn, retire_after_s: float) -> set[bytes]:
        """Namespaces of a superseded model fingerprint (see ``Store.retired_namespaces``)."""
        last: dict[tuple[str, str | None], float] = {}
        owners: dict[tuple[str, str | None], list[bytes]] = {}
        for k, v in t.rows("namespaces"):
            try:
                doc = json.loads(bytes(v))
                nsd = doc.get("namespace", {})
                ident = (str(nsd["model"]), nsd.get("model_fingerprint"))
                updated = float(doc.get("updated", 0))
            except (ValueError, KeyError, TypeError):
                continue
            last[ident] = max(last.get(ident, 0.0), updated)
            owners.setdefault(ident, []).append(bytes(k))
        current: dict[str, tuple[float, str | None]] = {}
        for (model, fp), updated in last.items():
            if model not in current or updated > current[model][0]:
                current[model] = (updated, fp)
        cutoff = self.clock.time() - retire_after_s
        return {nid for (model, fp), updated in last.items() if fp != current[model][1] and updated < cutoff
                for nid in owners[(model, fp)]}
