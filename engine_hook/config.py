"""The connector's settings: ``kv_connector_extra_config`` keys, checked once at start-up.

Every key is documented in docs/engine-hook.md. Unknown keys are refused, so a typo
does not silently fall back to a default.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from store import DEFAULT_CHUNK_SIZE, Store, StoreConfig, StoreError
from store.config import RemoteConfig, TierConfig, parse_capacity
from store.format.codec import codec_id

from .policy import POLICIES

LAYOUTS = ("BHNC", "2BNHD", "B2NHD", "B2HND")
MAX_CHUNK_SIZE = 1 << 16
#: each queued save holds one chunk-sized staging buffer, allocated up front
MAX_SAVE_QUEUE = 1024
#: the remote tier's trust settings (``remote_X`` sets the store's ``remote.X``; the boolean last)
_REMOTE_TRUST = ("remote_secret_file", "remote_previous_secret_file", "remote_trust", "remote_encrypt")


#: where default dram folders live: tmpfs, shared by every user (sticky, like /tmp)
DRAM_ROOT = "/dev/shm"


def default_dram_path(store: Store) -> str:
    """Where a connector's ``dram_capacity`` puts the dram tier unless ``dram_path`` says:
    ``/dev/shm/lmctl-UID/STORE-ID``, a folder per store under a parent private to this user
    (both 0700, made by the store and checked like every folder of it at each open: one that
    another user made first is refused)."""
    import hashlib

    name = store.store_id or hashlib.sha256(store.path.encode()).hexdigest()[:32]
    return os.path.join(DRAM_ROOT, f"lmctl-{os.geteuid()}", name)


def _whole(value: Any, name: str, lo: int, hi: int) -> int:
    """A whole number in [lo, hi]: ``True``, ``1.9`` or ``"16"`` are refused, not rounded."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise StoreError(f"{name} must be a whole number, not {value!r}")
    if not lo <= value <= hi:
        raise StoreError(f"{name} must be between {lo} and {hi}, not {value}")
    return value


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
    load_policy: str = "auto"
    dram_capacity: int | None = None
    dram_path: str | None = None
    remote_url: str | None = None
    remote_key_prefix: str | None = None
    remote_write: str | None = None
    remote_secret_file: str | None = None
    remote_previous_secret_file: str | None = None
    remote_encrypt: bool | None = None
    remote_trust: str | None = None
    reannounce: bool = True

    @classmethod
    def parse(cls, extra: dict[str, Any]) -> ConnectorSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise StoreError(f"unknown lmctl connector setting(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        path = extra.get("store_path")
        if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
            raise StoreError(f"kv_connector_extra_config needs 'store_path': the lmctl store folder, as a path "
                             f"string (got {path!r})")
        chunk = _whole(extra.get("chunk_size", DEFAULT_CHUNK_SIZE), "chunk_size", 1, MAX_CHUNK_SIZE)
        queue = _whole(extra.get("save_queue", 16), "save_queue", 1, MAX_SAVE_QUEUE)
        for key in ("model_id", "kv_layout", "codec", "on_load_error", "load_policy", "remote_url",
                    "remote_key_prefix", "remote_write", "dram_path", *_REMOTE_TRUST[:-1]):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise StoreError(f"{key} must be a string, not {extra[key]!r}")
        if extra.get("dram_path") and not os.path.isabs(extra["dram_path"]):  # recorded in the store for every process
            raise StoreError(f"dram_path {extra['dram_path']!r} must be an absolute folder path (each process that "
                             "opens the store would find a relative one from its own working folder)")
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
        load_policy = str(extra.get("load_policy", "auto"))
        if load_policy not in POLICIES:
            raise StoreError(f"load_policy must be one of {', '.join(POLICIES)}, not {load_policy!r}")
        encrypt = extra.get("remote_encrypt")
        if encrypt is not None and not isinstance(encrypt, bool):
            raise StoreError(f"remote_encrypt must be true or false, not {encrypt!r}")
        if extra.get("remote_url") is not None:
            try:
                RemoteConfig(str(extra["remote_url"]), key_prefix=str(extra.get("remote_key_prefix") or "lmctl"),
                             write=str(extra.get("remote_write") or "always"),
                             **{k[7:]: extra[k] for k in _REMOTE_TRUST if extra.get(k) is not None}).validate()
            except StoreError as exc:  # the store's setting names, as the connector spells them
                raise StoreError(str(exc).replace("remote.", "remote_")) from None
        elif any(extra.get(k) is not None for k in ("remote_key_prefix", "remote_write", *_REMOTE_TRUST)):
            raise StoreError(f"remote_key_prefix, remote_write and {', '.join(_REMOTE_TRUST)} need remote_url")
        reannounce = extra.get("reannounce", True)
        if not isinstance(reannounce, bool):
            raise StoreError(f"reannounce must be true or false, not {reannounce!r}")
        layout = extra.get("kv_layout")
        if layout is not None and layout not in LAYOUTS:
            raise StoreError(f"kv_layout must be one of {', '.join(LAYOUTS)}")
        return cls(
            store_path=os.path.abspath(os.fspath(path)), chunk_size=chunk,
            codec=None if codec is None else str(codec),
            capacity=None if cap is None else parse_capacity(cap, "capacity"), save_queue=queue,
            model_id=extra.get("model_id") or None, model_fingerprint=fp,
            on_load_error=policy, kv_layout=layout, load_policy=load_policy,
            remote_url=extra.get("remote_url") or None, remote_key_prefix=extra.get("remote_key_prefix") or None,
            remote_write=extra.get("remote_write") or None,
            remote_secret_file=extra.get("remote_secret_file") or None,
            remote_previous_secret_file=extra.get("remote_previous_secret_file") or None,
            remote_encrypt=encrypt, remote_trust=extra.get("remote_trust") or None,
            dram_capacity=None if extra.get("dram_capacity") is None else parse_capacity(extra["dram_capacity"],
                                                                                         "dram_capacity"),
            dram_path=extra.get("dram_path") or None, reannounce=reannounce,
        )

    def fingerprint_mode(self) -> str:
        """``auto`` (computed from the weights), ``off`` (none) or ``explicit``."""
        return self.model_fingerprint if self.model_fingerprint in ("auto", "off") else "explicit"

    def apply(self, store: Store) -> None:
        """Apply ``codec``, ``capacity`` (of the store's default tier) and the remote tier's
        settings if they were given."""
        if self.codec is None and self.capacity is None and self.remote_url is None and self.dram_capacity is None:
            return
        cfg = StoreConfig.from_json(store.config.to_json())
        if self.codec is not None:
            cfg.codec = self.codec
        if self.capacity is not None:  # the disk tier's, whatever the default tier is
            cfg.tiers["nvme" if "nvme" in cfg.tiers else cfg.default_tier].capacity = self.capacity
        if self.dram_capacity is not None:
            # saves go to dram; under pressure they are demoted to nvme, and nvme hits promoted
            dram = cfg.tiers.get("dram")
            path = self.dram_path or (dram.path if dram is not None else None) or default_dram_path(store)
            if dram is None:
                cfg.tiers["dram"] = TierConfig(capacity=self.dram_capacity, path=path)
            else:
                dram.capacity = self.dram_capacity
            cfg.default_tier = "dram"
        if self.remote_url is not None:
            old = cfg.remote
            cfg.remote = RemoteConfig(self.remote_url)
            if old is not None and old.url == self.remote_url:
                cfg.remote = old
            if self.remote_key_prefix is not None:
                cfg.remote.key_prefix = self.remote_key_prefix
            if self.remote_write is not None:
                cfg.remote.write = self.remote_write
            if self.remote_secret_file is not None or self.remote_trust is not None:
                cfg.remote.secret_file = cfg.remote.trust = None  # the connector says whom to trust, not the store
            for name in _REMOTE_TRUST:  # given: the connector's; else what the store has for this URL
                if getattr(self, name) is not None:
                    setattr(cfg.remote, name[7:], getattr(self, name))
            cfg.validate()
        if cfg.to_json() != store.config.to_json():
            store.configure(cfg)
