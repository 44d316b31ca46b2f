"""The connector's settings: ``kv_connector_extra_config`` keys, checked once at start-up.

Every key is documented in docs/engine-hook.md. Unknown keys are refused, so a typo
does not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from store import DEFAULT_CHUNK_SIZE, Store, StoreConfig, StoreError
from store.codec import codec_id
from store.config import parse_size

LAYOUTS = ("BHNC", "2BNHD", "B2NHD", "B2HND")


@dataclass(frozen=True)
class ConnectorSettings:
    store_path: str
    chunk_size: int = DEFAULT_CHUNK_SIZE
    codec: str | None = None
    capacity: int | None = None
    save_queue: int = 16
    model_id: str | None = None
    model_fingerprint: str = "auto"
    on_load_error: str = "recompute"
    kv_layout: str | None = None

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise StoreError(f"unknown lmctl connector setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        if not extra.get("store_path"):
            raise StoreError("kv_connector_extra_config needs 'store_path' (the lmctl store folder)")
        try:
            chunk = int(extra.get("chunk_size", DEFAULT_CHUNK_SIZE))
            queue = int(extra.get("save_queue", 16))
        except (TypeError, ValueError):
            raise StoreError("chunk_size and save_queue must be integers") from None
        if chunk <= 0 or queue < 1:
            raise StoreError("chunk_size must be positive and save_queue at least 1")
        codec = extra.get("codec")
        if codec is not None:
            codec_id(str(codec))
        cap = extra.get("capacity")
        policy = str(extra.get("on_load_error", "recompute"))
        if policy not in ("recompute", "fail"):
            raise StoreError("on_load_error must be 'recompute' or 'fail'")
        fp = extra.get("model_fingerprint", "auto")
        fp = "auto" if fp is None else str(fp).strip()
        if not fp:
            raise StoreError("model_fingerprint must be 'auto' (the default), 'off' or a non-empty string")
        if fp.lower() in ("auto", "off"):
            fp = fp.lower()
        layout = extra.get("kv_layout")
        if layout is not None and layout not in LAYOUTS:
            raise StoreError(f"kv_layout must be one of {', '.join(LAYOUTS)}")
        return cls(
            store_path=str(extra["store_path"]), chunk_size=chunk, codec=None if codec is None else str(codec),
            capacity=None if cap is None else parse_size(cap), save_queue=queue,
            model_id=extra.get("model_id") or None, model_fingerprint=fp,
            on_load_error=policy, kv_layout=layout,
        )

    def fingerprint_mode(self) -> str:
        """``auto`` (computed from the weights), ``off`` (none) or ``explicit``."""
        return self.model_fingerprint if self.model_fingerprint in ("auto", "off") else "explicit"

    def apply(self, store: Store) -> None:
        """Apply ``codec`` and ``capacity`` (of the store's default tier) if they were given."""
        if self.codec is None and self.capacity is None:
            return
        cfg = StoreConfig.from_json(store.config.to_json())
        if self.codec is not None:
            cfg.codec = self.codec
        if self.capacity is not None:
            cfg.tiers[cfg.default_tier].capacity = self.capacity
        if cfg.to_json() != store.config.to_json():
            store.configure(cfg)
