"""The namespaces an engine uses, recorded in the store for operators (``NamespaceBook``).

Used by the vLLM connector (both sides) and by ``KVCacheClient``. Pure Python: no torch,
no vllm.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from store import AdapterIdentity, KVFormat, Namespace, Store

log = logging.getLogger("lmctl.engine_hook")


class NamespaceBook:
    """Builds namespaces and records each one in the store, with the facts an operator
    needs to turn a document into keys later (model id, tokenizer, model fingerprint).

    A namespace is recorded at its first use in this process, and again at its first
    use after ``refresh_s`` seconds, so that the store learns which namespaces (which
    model fingerprints) engines still use. The check costs a dict lookup per ``get``."""

    REFRESH_S = 300.0
    RETRY_S = 30.0

    def __init__(self, store: Store, model: str, info: dict[str, Any],
                 model_fingerprint: str | None = None, *, refresh_s: float = REFRESH_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.model = model
        self.info = dict(info)
        if model_fingerprint is not None:
            self.info["model_fingerprint"] = model_fingerprint
        self.model_fingerprint = model_fingerprint
        self.refresh_s = refresh_s
        self.clock = clock
        self._recorded: dict[bytes, float] = {}  # ns id -> when it was last recorded
        self._lock = threading.Lock()

    def get(self, kv_format: KVFormat, adapter: AdapterIdentity | None, cache_salt: str | None,
            adapter_path: str | None = None) -> Namespace:
        ns = Namespace(self.model, kv_format, adapter, cache_salt or None, self.model_fingerprint)
        nid = ns.ns_id
        now = self.clock()
        last = self._recorded.get(nid)
        if last is not None and now - last < self.refresh_s:
            return ns
        with self._lock:  # one caller records; the others go on with the namespace
            last = self._recorded.get(nid)
            if last is not None and now - last < self.refresh_s:
                return ns
            self._recorded[nid] = now
        info = dict(self.info)
        info["model_id"] = self.model
        if adapter is not None:
            info["adapter"] = str(adapter)
            if adapter_path:
                info["adapter_path"] = adapter_path
        if self.store.readonly:
            return ns
        try:
            self.store.register_namespace(ns, info)
        except Exception:
            with self._lock:
                if last is None:  # never recorded: try again at the next use
                    self._recorded.pop(nid, None)
                else:  # recorded before: try again in RETRY_S, not at every lookup
                    self._recorded[nid] = now - self.refresh_s + min(self.RETRY_S, self.refresh_s)
            if last is None:
                raise  # the caller decides (a lookup then misses)
            log.warning("lmctl: could not record namespace %s in the store again; retrying in %.0f s",
                        nid.hex()[:12], min(self.RETRY_S, self.refresh_s), exc_info=True)
        return ns
