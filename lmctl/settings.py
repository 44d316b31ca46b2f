"""Store settings by name: one vocabulary for ``lmctl config set``, ``lmctl serve``'s flags
and its TOML config file.

A setting is a dotted name and a value: ``codec``, ``codec_level``, ``tiers.nvme.capacity``,
``tiers.dram.path``, ``tiers.nvme.pin_budget`` ... Values may be typed (TOML) or text (the
command line): sizes accept ``500GiB``, durations ``90s``/``12h``/``7d``. Every change is
validated on a copy of the settings; nothing is applied unless all of it is valid.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Iterable, Mapping
from typing import Any

from store import StoreConfig, StoreError, TierConfig
from store.config import EVENT_LOG_MAX, TIER_ORDER, RemoteConfig, parse_capacity, parse_size, parse_unit_size

from .errors import UsageError
from .units import parse_duration

#: store-wide settings and how their values are read
STORE_KEYS = ("codec", "codec_level", "default_tier", "segment_bytes", "fsync", "low_watermark",
              "access_flush_s", "compact_dead_ratio", "retire_after_s", "compress_cold_after_s", "event_log_max")
TIER_KEYS = ("capacity", "path", "pin_budget")
#: the remote tier's settings, ``remote.KEY`` (``remote.url`` "" or "none" removes the tier)
REMOTE_KEYS = ("url", "key_prefix", "write", "promote", "piece_bytes", "lookup_timeout_s", "io_timeout_s",
               "password_file")
#: settings that make the daemon read a file or connect somewhere, or that lower what it
#: checks: only the store's owner (the daemon's user) or root may change them through the
#: daemon (``fnmatch`` patterns; names of settings other versions have are kept too)
OWNER_ONLY = ("remote.url", "remote.password_file", "remote.secret_file", "remote.previous_secret_file",
              "remote.trust", "remote.encrypt", "tiers.*.path")
#: daemon settings a config file may hold (not recorded in the store)
DAEMON_KEYS = ("store", "socket", "allow_uid", "maintenance_interval", "log_level", "socket_mode", "socket_group",
               "metrics")

def _duration(value: Any, name: str) -> float:
    """Seconds: a number (TOML) or a duration like ``"12h"``."""
    if isinstance(value, bool):
        raise StoreError(f"{name} {value!r} is not a duration like 90s, 30m, 12h or 7d")
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return parse_duration(str(value))
    except ValueError as exc:
        raise StoreError(f"{name}: {exc}") from None


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "yes", "on", "1"):
        return True
    if text in ("false", "no", "off", "0"):
        return False
    raise StoreError(f"{name} must be true or false, not {value!r}")


def _number(value: Any, name: str, kind: type = float) -> Any:
    if isinstance(value, bool):
        raise StoreError(f"{name} must be a number, not {value!r}")
    try:
        n = float(value)
    except (TypeError, ValueError, OverflowError):
        raise StoreError(f"{name} must be a number, not {value!r}") from None
    if n != n or n in (float("inf"), float("-inf")):
        raise StoreError(f"{name} must be a finite number, not {value!r}")
    if kind is int:
        if n != int(n):
            raise StoreError(f"{name} must be a whole number, not {value!r}")
        if isinstance(value, int):
            return value
        try:  # a whole number as written, not as a float rounded it
            return int(str(value).strip())
        except ValueError:
            return int(n)
    return n


def _pin_budget(value: Any, name: str) -> float:
    """A fraction of the tier's capacity (0-1) or a size (``100GiB``)."""
    if isinstance(value, str) and re.search(r"[a-zA-Z]", value):
        return float(parse_size(value))
    n = _number(value, name)
    if not 0 <= n <= 1:
        raise StoreError(f"{name} {value!r}: give a fraction of the capacity between 0 and 1, or a size with "
                         "a unit (100GiB)")
    return float(n)


def _read_store_key(key: str, value: Any) -> Any:
    if key == "codec":
        from store.codec import codec_id

        codec_id(str(value))
        return str(value)
    if key == "codec_level":
        lvl = _number(value, key, int)
        if not 1 <= lvl <= 19:
            raise StoreError("codec_level must be between 1 and 19")
        return lvl
    if key == "default_tier":
        return str(value)
    if key == "segment_bytes":
        return parse_unit_size(value, key)
    if key == "fsync":
        return _bool(value, key)
    if key in ("access_flush_s", "retire_after_s", "compress_cold_after_s"):
        secs = _duration(value, key)
        if secs < 0:
            raise StoreError(f"{key} must not be negative")
        return secs
    if key == "event_log_max":
        n = _number(value, key, int)
        if not 1 <= n <= EVENT_LOG_MAX:
            raise StoreError(f"event_log_max must be between 1 and {EVENT_LOG_MAX} (events the store's event log "
                             "keeps)")
        return n
    return _number(value, key)  # low_watermark, compact_dead_ratio: validate() checks ranges


def owner_only(names: Iterable[str]) -> list[str]:
    """The settings among ``names`` that only the store's owner or root may change."""
    return sorted(n for n in map(str, names) if any(fnmatch.fnmatchcase(n, p) for p in OWNER_ONLY))


def apply_settings(config: StoreConfig, changes: Mapping[str, Any]) -> StoreConfig:
    """A validated copy of ``config`` with ``changes`` ({dotted name: value}) applied.
    Naming a tier that is not configured adds it (its capacity is then required)."""
    cfg = StoreConfig.from_json(config.to_json())
    for name, value in changes.items():
        parts = str(name).split(".")
        if len(parts) == 1 and parts[0] in STORE_KEYS:
            setattr(cfg, parts[0], _read_store_key(parts[0], value))
        elif len(parts) == 3 and parts[0] == "tiers" and parts[2] in TIER_KEYS:
            tier, field = parts[1], parts[2]
            if tier not in TIER_ORDER:
                raise StoreError(f"unknown tier {tier!r} in {name}; local tiers are {', '.join(TIER_ORDER)}")
            t = cfg.tiers.get(tier)
            if t is None:
                t = cfg.tiers[tier] = TierConfig(capacity=0)
            if field == "capacity":
                t.capacity = parse_capacity(value, name)
            elif field == "path":
                t.path = str(value) or None
            else:
                t.pin_budget = _pin_budget(value, name)
        elif len(parts) == 2 and parts[0] == "remote" and parts[1] in REMOTE_KEYS:
            _set_remote(cfg, parts[1], value, name)
        else:
            raise StoreError(f"unknown setting {name!r}; settings are {', '.join(STORE_KEYS)}, "
                             f"tiers.TIER.{{{','.join(TIER_KEYS)}}} (TIER: {', '.join(TIER_ORDER)}) and "
                             f"remote.{{{','.join(REMOTE_KEYS)}}}")
    if cfg.remote is not None and not cfg.remote.url:
        raise StoreError("the remote tier needs remote.url (redis://HOST:PORT/DB, rediss://... or unix:///PATH)")
    cfg.validate()
    return cfg


def _set_remote(cfg: StoreConfig, field: str, value: Any, name: str) -> None:
    if field == "url" and str(value).strip().lower() in ("", "none"):
        cfg.remote = None
        return
    if cfg.remote is None:
        cfg.remote = RemoteConfig(url="")
    r = cfg.remote
    if field in ("url", "key_prefix", "write"):
        setattr(r, field, str(value))
    elif field == "password_file":
        r.password_file = str(value) or None
    elif field == "promote":
        r.promote = _bool(value, name)
    elif field == "piece_bytes":
        r.piece_bytes = parse_unit_size(value, name)
    else:
        secs = _duration(value, name)
        if secs <= 0:
            raise StoreError(f"{name} must be positive")
        setattr(r, field, secs)


def settings_json(config: StoreConfig) -> dict[str, Any]:
    """The settings as shown to operators: the remote tier's URL without its password."""
    doc = dataclasses.asdict(config)
    if config.remote is not None:
        from store.remote import redacted

        doc["remote"]["url"] = redacted(config.remote.url)
    return doc


def flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"tiers": {"nvme": {"capacity": "1TB"}}}`` -> ``{"tiers.nvme.capacity": "1TB"}``."""
    out: dict[str, Any] = {}
    for k, v in doc.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, name + "."))
        else:
            out[name] = v
    return out


def read_config_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TOML config file: ``([daemon] settings, store settings as dotted names)``.

    Layout: a ``[daemon]`` table (``store``, ``socket``, ``allow_uid``,
    ``maintenance_interval``, ``log_level``, ``socket_mode``, ``socket_group``), a
    ``[store]`` table of store settings and ``[tiers.NAME]`` tables."""
    import tomllib

    try:
        with open(path, "rb") as f:
            doc = tomllib.load(f)
    except OSError as exc:
        raise StoreError(f"cannot read config file {path}: {exc.strerror}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise StoreError(f"config file {path} is not valid TOML: {exc}") from None
    unknown = sorted(set(doc) - {"daemon", "store", "tiers", "remote"})
    if unknown:
        raise StoreError(f"config file {path}: unknown table(s) {', '.join(unknown)}; "
                         "tables are [daemon], [store], [tiers.NAME] and [remote]")
    daemon = dict(doc.get("daemon") or {})
    bad = sorted(set(daemon) - set(DAEMON_KEYS))
    if bad:
        raise StoreError(f"config file {path}: unknown [daemon] setting(s) {', '.join(bad)}; "
                         f"known: {', '.join(DAEMON_KEYS)}")
    for key, kinds, what in (("store", (str,), "a folder path"), ("socket", (str,), "a socket path"),
                             ("log_level", (str,), "debug, info, warning or error"),
                             ("socket_mode", (str,), 'an octal mode in quotes ("0660")'),
                             ("socket_group", (str, int), "a group name or gid"),
                             ("metrics", (str, int), 'a port or "ADDR:PORT" for the Prometheus exporter'),
                             ("maintenance_interval", (int, float), "a number of seconds")):
        v = daemon.get(key)
        if v is not None and (not isinstance(v, kinds) or isinstance(v, bool)):
            raise StoreError(f"config file {path}: [daemon] {key} must be {what}, not {v!r}")
    uids = daemon.get("allow_uid")
    if uids is not None and (not isinstance(uids, list) or not all(
            isinstance(u, int) and not isinstance(u, bool) for u in uids)):
        raise StoreError(f"config file {path}: [daemon] allow_uid must be a list of uids (integers), not {uids!r}")
    changes = flatten(doc.get("store") or {})
    changes.update(flatten({"tiers": doc.get("tiers") or {}}))
    changes.update(flatten({"remote": doc.get("remote") or {}}))
    return daemon, changes


def _pairs(values: list[str] | None, flag: str, default_key: str | None = None) -> list[tuple[str, str]]:
    """``TIER=VALUE`` flags (``VALUE`` alone means ``default_key``)."""
    out = []
    for v in values or []:
        k, sep, val = v.partition("=")
        if not sep:
            if default_key is None:
                raise UsageError(f"{flag} {v!r}: expected TIER=VALUE")
            k, val = default_key, v
        if not k or not val:
            raise UsageError(f"{flag} {v!r}: expected TIER=VALUE")
        out.append((k.strip(), val.strip()))
    return out


def serve_settings(config: str | None, *, capacity: list[str] | None = None, tier_path: list[str] | None = None,
                   pin_budget: list[str] | None = None, codec: str | None = None, codec_level: int | None = None,
                   remote: str | None = None,
                   settings: list[str] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``lmctl serve``'s settings from ``--config FILE`` and its flags (flags win): ``(daemon,
    store)``, the store's as dotted names (``tiers.@default.capacity`` for the default tier's).
    Everything wrong here is a ``UsageError``; the values are checked when they are applied."""
    daemon: dict[str, Any] = {}
    store: dict[str, Any] = {}
    if config:
        try:
            daemon, store = read_config_file(config)
        except StoreError as exc:
            raise UsageError(str(exc)) from None
    for tier, val in _pairs(tier_path, "--tier-path"):
        store[f"tiers.{tier}.path"] = val
    for tier, val in _pairs(capacity, "--capacity", "@default"):
        store[f"tiers.{tier}.capacity"] = val
    for tier, val in _pairs(pin_budget, "--pin-budget", "@default"):
        store[f"tiers.{tier}.pin_budget"] = val
    if codec is not None:
        store["codec"] = codec
    if codec_level is not None:
        store["codec_level"] = codec_level
    if remote is not None:
        store["remote.url"] = remote
    for k, val in _pairs(settings, "--set"):
        store[k] = val
    return daemon, store
