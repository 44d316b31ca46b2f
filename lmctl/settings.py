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
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from store import StoreConfig, StoreError, TierConfig
from store.config import (
    ADMIT_GHOSTS_MAX,
    ADMIT_MODES,
    EVENT_LOG_MAX,
    TIER_ORDER,
    RemoteConfig,
    parse_capacity,
    parse_size,
    parse_unit_size,
    parse_write_budget,
)

from .completion import flatten
from .errors import UsageError
from .units import format_duration, parse_duration

#: store-wide settings and how their values are read
STORE_KEYS = ("codec", "codec_level", "default_tier", "segment_bytes", "fsync", "low_watermark",
              "access_flush_s", "compact_dead_ratio", "retire_after_s", "compress_cold_after_s", "event_log_max",
              "admit", "admit_ghosts", "eviction")
#: ``write_budget`` is the nvme tier's only (``tiers.nvme.write_budget``; a dram tier does not wear)
TIER_KEYS = ("capacity", "path", "pin_budget", "write_budget")
#: the remote tier's settings, ``remote.KEY`` (``remote.url`` "" or "none" removes the tier)
REMOTE_KEYS = ("url", "key_prefix", "write", "promote", "piece_bytes", "lookup_timeout_s", "io_timeout_s",
               "password_file", "secret_file", "previous_secret_file", "encrypt", "trust")
#: settings that make the daemon read a file or connect somewhere, or that lower what it
#: checks: only the store's owner (the daemon's user) or root may change them through the
#: daemon (``fnmatch`` patterns; names of settings other versions have are kept too)
OWNER_ONLY = ("remote.url", "remote.password_file", "remote.secret_file", "remote.previous_secret_file",
              "remote.trust", "remote.encrypt", "tiers.*.path")
#: daemon settings a config file may hold (not recorded in the store)
DAEMON_KEYS = ("store", "socket", "allow_uid", "allow_uid_ro", "maintenance_interval", "log_level", "socket_mode",
               "socket_group", "metrics")

#: the range each duration setting accepts, in seconds: beyond it a value is a mistake (a
#: maintenance pass every nanosecond burns a core; an infinite timeout is no timeout)
DURATION_BOUNDS = {
    "maintenance_interval": (0.1, 7 * 86400.0),
    "access_flush_s": (0.1, 3600.0),
    "retire_after_s": (0.0, 3650 * 86400.0),
    "compress_cold_after_s": (0.0, 3650 * 86400.0),
    "remote.lookup_timeout_s": (0.001, 60.0),
    "remote.io_timeout_s": (0.01, 600.0),
}
#: the range of the other numbers that have one (segment and piece sizes in bytes, a ratio)
NUMBER_BOUNDS = {
    "segment_bytes": (64 << 10, 1 << 40, "64KiB to 1TiB"),
    "remote.piece_bytes": (64 << 10, 512 << 20, "64KiB to 512MiB"),  # a Redis value holds at most 512 MiB
    "compact_dead_ratio": (0.01, 1.0, "0.01 to 1"),
}


def shown(value: Any) -> str:
    """A value as an error message quotes it: never a 400-digit number in full."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _duration(value: Any, name: str, label: str | None = None, *, unit_required: bool = True) -> float:
    """Seconds from a duration like ``"12h"``, within ``DURATION_BOUNDS`` (``label``: the
    setting's name as the operator wrote it, when not ``name``). What an operator typed or
    wrote in a config file needs its unit, as a size does: a bare ``7`` (or TOML's ``7``) is
    refused, it may well mean seven days. Without ``unit_required`` (a value a program gives,
    in seconds) a number is seconds."""
    label = label or name
    if isinstance(value, bool):
        raise StoreError(f"{label} {value!r} is not a duration like 90s, 30m, 12h or 7d")
    if isinstance(value, (int, float)):
        if unit_required:
            raise StoreError(f'{label} {shown(value)} has no unit: write a duration in quotes, like "30s", "12h" '
                             'or "7d"')
        try:
            secs = float(value)
        except OverflowError:
            secs = float("inf")
    else:
        try:
            secs = parse_duration(str(value), unit_required=unit_required)
        except ValueError as exc:
            raise StoreError(f"{label}: {exc}") from None
    lo, hi = DURATION_BOUNDS.get(name, (0.0, float("inf")))
    if not lo <= secs <= hi:  # NaN fails too
        raise StoreError(f"{label} {shown(value)} is out of range: give {format_duration(lo)} to {format_duration(hi)}")
    return secs


def maintenance_interval(value: Any, label: str = "--maintenance-interval") -> float:
    """``--maintenance-interval`` (seconds, a number), checked; the config file's ``[daemon]
    maintenance_interval`` is a duration with a unit (``read_config_file`` reads it)."""
    try:
        return _duration(value, "maintenance_interval", label, unit_required=False)
    except StoreError as exc:
        raise UsageError(str(exc)) from None


def _bounded(n: Any, name: str) -> Any:
    lo, hi, text = NUMBER_BOUNDS[name]
    if not lo <= n <= hi:
        raise StoreError(f"{name} {shown(n)} is out of range: give {text}")
    return n


def _text(value: Any, name: str) -> str:
    """A path or a word from operator input ("none" and "" say: not set)."""
    if not isinstance(value, str):
        raise StoreError(f"{name} must be a string, not {value!r}")
    return "" if value.strip().lower() in ("", "none") else value.strip()


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
        raise StoreError(f"{name} must be a finite number, not {shown(value)}") from None
    if n != n or n in (float("inf"), float("-inf")):
        raise StoreError(f"{name} must be a finite number, not {shown(value)}")
    if kind is int:
        if n != int(n):
            raise StoreError(f"{name} must be a whole number, not {shown(value)}")
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
        from store.format.codec import codec_id

        codec_id(str(value))
        return str(value)
    if key == "codec_level":
        lvl = _number(value, key, int)
        if not 1 <= lvl <= 19:
            raise StoreError("codec_level must be between 1 and 19")
        return lvl
    if key == "default_tier":
        return str(value)
    if key == "eviction":
        from store.config import EVICTION_POLICIES

        if value not in EVICTION_POLICIES:
            raise StoreError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, not {shown(value)}")
        return value
    if key == "segment_bytes":
        return _bounded(parse_unit_size(value, key), key)
    if key == "fsync":
        return _bool(value, key)
    if key in ("access_flush_s", "retire_after_s", "compress_cold_after_s"):
        return _duration(value, key)
    if key == "event_log_max":
        n = _number(value, key, int)
        if not 1 <= n <= EVENT_LOG_MAX:
            raise StoreError(f"event_log_max must be between 1 and {EVENT_LOG_MAX} (events the store's event log "
                             "keeps)")
        return n
    if key == "compact_dead_ratio":
        return _bounded(_number(value, key), key)
    if key == "admit":
        if not isinstance(value, str) or value.strip() not in ADMIT_MODES:
            raise StoreError(f"admit {shown(value)} is not a mode: give {' or '.join(ADMIT_MODES)}")
        return value.strip()
    if key == "admit_ghosts":
        n = _number(value, key, int)
        if not 1 <= n <= ADMIT_GHOSTS_MAX:
            raise StoreError(f"admit_ghosts must be between 1 and {ADMIT_GHOSTS_MAX} (chunk keys the ghost list "
                             "remembers)")
        return n
    return _number(value, key)  # low_watermark: validate() checks its range


def owner_only(names: Iterable[str]) -> list[str]:
    """The settings among ``names`` that only the store's owner or root may change."""
    return sorted(n for n in map(str, names) if any(fnmatch.fnmatchcase(n, p) for p in OWNER_ONLY))


def check_values(changes: Mapping[str, Any]) -> None:
    """Refuse any change whose name or value is wrong whatever the store (``StoreError``), as
    ``serve`` does before it opens or creates a store. Whether the settings fit together is
    known only once the store's own are: ``apply_settings`` checks that."""
    apply_settings(StoreConfig(), {k.replace("tiers.@default.", "tiers.nvme."): v for k, v in changes.items()},
                   whole=False)


def apply_settings(config: StoreConfig, changes: Mapping[str, Any], *, whole: bool = True) -> StoreConfig:
    """A validated copy of ``config`` with ``changes`` ({dotted name: value}) applied.
    Naming a tier that is not configured adds it (its capacity is then required). Without
    ``whole``, each value is checked but not the settings as a whole."""
    cfg = StoreConfig.from_json(config.to_json())
    # remote.url first: the tier it turns on (or off) is the one the other remote.* settings change
    for name, value in sorted(changes.items(), key=lambda kv: kv[0] != "remote.url"):
        if "\0" in str(name) or "\0" in str(value):
            raise StoreError(f"setting {shown(str(name))}: a NUL character is in its name or value; remove it")
        parts = str(name).split(".")
        if len(parts) == 1 and parts[0] in STORE_KEYS:
            setattr(cfg, parts[0], _read_store_key(parts[0], value))
        elif len(parts) == 2 and parts[0] == "tiers" and parts[1] in TIER_ORDER:
            if _text(value, name):
                raise StoreError(f"{name} takes none (to remove the tier, if it is empty); set the tier's "
                                 f"{name}.capacity, {name}.path or {name}.pin_budget instead")
            if parts[1] not in cfg.tiers:
                raise StoreError(f"{name}=none: this store has no tier {parts[1]}")
            del cfg.tiers[parts[1]]  # the store refuses it while the tier holds chunks
        elif len(parts) == 3 and parts[0] == "tiers" and parts[2] in TIER_KEYS:
            tier, field = parts[1], parts[2]
            if tier not in TIER_ORDER:
                raise StoreError(f"unknown tier {tier!r} in {name}; local tiers are {', '.join(TIER_ORDER)}")
            t = cfg.tiers.get(tier)
            if t is None:
                t = cfg.tiers[tier] = TierConfig(capacity=0)
            if field == "capacity":
                t.capacity = parse_capacity(value, name)
            elif field == "write_budget":
                if tier != "nvme":
                    raise StoreError(f"{name}: only the nvme tier takes a write budget (a dram tier does not wear)")
                budget = _text(value, name) or None
                parse_write_budget(budget, t.capacity or 1 << 30)  # the syntax, whatever the capacity
                t.write_budget = budget
            elif field == "path":
                if not isinstance(value, str) or (value and not os.path.isabs(value)):
                    raise StoreError(f"{name} {shown(value)} must be an absolute folder path (the daemon's "
                                     "working folder is not yours)")
                t.path = value or None
            else:
                t.pin_budget = _pin_budget(value, name)
        elif len(parts) == 2 and parts[0] == "remote" and parts[1] in REMOTE_KEYS:
            _set_remote(cfg, parts[1], value, name)
        else:
            raise StoreError(f"unknown setting {name!r}; settings are {', '.join(STORE_KEYS)}, "
                             f"tiers.TIER.{{{','.join(TIER_KEYS)}}} and tiers.TIER=none (TIER: "
                             f"{', '.join(TIER_ORDER)}) and "
                             f"remote.{{{','.join(REMOTE_KEYS)}}}")
    if not whole:
        return cfg
    if cfg.remote is not None and not cfg.remote.url:
        raise StoreError("the remote tier needs remote.url (redis://HOST:PORT/DB, rediss://... or unix:///PATH)")
    cfg.validate()
    return cfg


def _set_remote(cfg: StoreConfig, field: str, value: Any, name: str) -> None:
    if field == "url" and str(value).strip().lower() in ("", "none"):
        if cfg.remote is not None:  # kept for a later remote.url: the tier comes back as it was
            cfg.remote_off, cfg.remote = cfg.remote, None
        return
    if cfg.remote is None:  # a new url takes up the settings the tier had when it was turned off
        revived = cfg.remote_off if field == "url" else None
        cfg.remote = revived or RemoteConfig(url="")
        if revived is not None:
            cfg.remote_off = None
    r = cfg.remote
    if field in ("url", "key_prefix", "write"):
        setattr(r, field, str(value))
    elif field in ("password_file", "secret_file", "previous_secret_file"):
        path = _text(value, name) or None  # "" (or "none") removes it
        if path is not None and not os.path.isabs(path):
            raise StoreError(f"{name} {shown(value)} must be an absolute file path")
        setattr(r, field, path)
    elif field == "trust":
        setattr(r, field, _text(value, name) or None)
    elif field in ("promote", "encrypt"):
        setattr(r, field, _bool(value, name))
    elif field == "piece_bytes":
        r.piece_bytes = _bounded(parse_unit_size(value, name), name)
    else:
        setattr(r, field, _duration(value, name))


def settings_json(config: StoreConfig) -> dict[str, Any]:
    """The settings as shown to operators: the remote tier's URL without its password."""
    doc = dataclasses.asdict(config)
    del doc["remote_off"]  # not a setting: what remote.url=URL takes up again
    if config.remote is not None:
        from store.tiers.remote import redacted

        doc["remote"]["url"] = redacted(config.remote.url)
    return doc


def read_config_file(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A TOML config file: ``([daemon] settings, store settings as dotted names)``.

    Layout: a ``[daemon]`` table (``store``, ``socket``, ``allow_uid``, ``allow_uid_ro``,
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
    except RecursionError:
        raise StoreError(f"config file {path} nests arrays or tables too deeply to be a config file") from None
    unknown = sorted(set(doc) - {"daemon", "store", "tiers", "remote"})
    if unknown:
        raise StoreError(f"config file {path}: unknown table(s) {', '.join(unknown)}; "
                         "tables are [daemon], [store], [tiers.NAME] and [remote]")
    for table in ("daemon", "store", "tiers", "remote"):
        if not isinstance(doc.get(table) or {}, dict):
            raise StoreError(f"config file {path}: {table} must be a table ([{table}]), not {shown(doc[table])}")
    daemon = dict(doc.get("daemon") or {})
    bad = sorted(set(daemon) - set(DAEMON_KEYS))
    if bad:
        raise StoreError(f"config file {path}: unknown [daemon] setting(s) {', '.join(bad)}; "
                         f"known: {', '.join(DAEMON_KEYS)}")
    for key, v in daemon.items():
        if isinstance(v, str) and "\0" in v:
            raise StoreError(f"config file {path}: [daemon] {key} holds a NUL character; remove it")
    for key, kinds, what in (("store", (str,), "a folder path"), ("socket", (str,), "a socket path"),
                             ("log_level", (str,), "debug, info, warning or error"),
                             ("socket_mode", (str,), 'an octal mode in quotes ("0660")'),
                             ("socket_group", (str, int), "a group name or gid"),
                             ("metrics", (str, int), 'a port or "ADDR:PORT" for the Prometheus exporter'),
                             ("maintenance_interval", (str, int, float), 'a duration like "30s"')):
        v = daemon.get(key)
        if v is not None and (not isinstance(v, kinds) or isinstance(v, bool)):
            raise StoreError(f"config file {path}: [daemon] {key} must be {what}, not {shown(v)}")
    for name in ("allow_uid", "allow_uid_ro"):
        uids = daemon.get(name)
        if uids is not None and (not isinstance(uids, list) or not all(
                isinstance(u, int) and not isinstance(u, bool) for u in uids)):
            raise StoreError(f"config file {path}: [daemon] {name} must be a list of uids (integers), "
                             f"not {shown(uids)}")
    try:
        for name in ("allow_uid", "allow_uid_ro"):
            for u in daemon.get(name) or []:
                check_id(u, name)
        if isinstance(daemon.get("socket_group"), int):
            check_id(daemon["socket_group"], "socket_group")
        if daemon.get("maintenance_interval") is not None:  # seconds from here on
            daemon["maintenance_interval"] = _duration(daemon["maintenance_interval"], "maintenance_interval")
    except (StoreError, UsageError) as exc:
        raise StoreError(f"config file {path}: [daemon] {exc}") from None
    try:
        changes = flatten(doc.get("store") or {})
        changes.update(flatten({"tiers": doc.get("tiers") or {}}))
        changes.update(flatten({"remote": doc.get("remote") or {}}))
    except RecursionError:
        raise StoreError(f"config file {path} nests tables too deeply to be a config file") from None
    return daemon, changes


#: the largest uid or gid (2**32 - 1 is (uid_t) -1: "no id")
MAX_ID = 2**32 - 2


def check_id(value: int, what: str) -> int:
    """A uid or gid (``what`` names it), within what the kernel takes."""
    if not 0 <= value <= MAX_ID:
        raise UsageError(f"{what} {shown(value)} is not a uid or gid (0 to {MAX_ID})")
    return value


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
        store[f"tiers.{tier}.path"] = os.path.abspath(val)  # serve runs where its operator is
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
    try:
        check_values(store)  # before any store is opened or made
    except StoreError as exc:
        raise UsageError(f"bad store setting: {exc}") from None
    return daemon, store
