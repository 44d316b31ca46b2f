"""Store settings. They are kept inside the store (LMDB meta table) so every process
that opens the store agrees on capacity, tiers and codec."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field

from .errors import StoreError

GiB = 1 << 30
MiB = 1 << 20

#: The local tiers a store can have, fastest first (the order they are opened and listed in). A
#: chunk is stored in exactly one tier and read from it. ``remote`` comes with the Redis tier.
TIER_ORDER = ("dram", "nvme")
#: every tier a chunk can be in, top to bottom: the local tiers, then the shared remote tier
TIER_LADDER = (*TIER_ORDER, "remote")
#: each tier's id as entries and segment records store it (on disk: never renumbered)
TIER_IDS = {"dram": 0, "nvme": 1, "remote": 2}
TIER_NAMES = {v: k for k, v in TIER_IDS.items()}


#: the most events ``event_log_max`` lets the log keep
EVENT_LOG_MAX = 10_000_000

@dataclass
class TierConfig:
    """One local tier: a directory of segment files with a byte capacity.

    ``pin_budget`` is the most bytes pinned chunks may hold in this tier: a fraction
    of the capacity when <= 1, else bytes.
    """

    capacity: int
    path: str | None = None
    pin_budget: float = 0.5
    #: the nvme tier's endurance budget: ``1DWPD`` (drive writes per day: the tier's capacity
    #: written once a day) or a size per day (``500GiB/day``); None: no budget. Every byte
    #: written to the tier counts (records, segment headers, compaction, dram spills);
    #: ``lmctl status`` warns when the store is on course to write more (store/tiers/admission.py)
    write_budget: str | None = None

    @property
    def write_budget_bytes(self) -> int | None:
        """The write budget in bytes per day (None: none)."""
        return parse_write_budget(self.write_budget, self.capacity)

    @property
    def pin_budget_bytes(self) -> int:
        return int(self.capacity * self.pin_budget) if self.pin_budget <= 1 else int(self.pin_budget)


REMOTE_WRITES = ("always", "evict", "never")
#: ``admit``: ``all`` writes every chunk an engine computes; ``second-hit`` writes a chunk to the
#: nvme tier only once its key has been put before (store/tiers/admission.py)
ADMIT_MODES = ("all", "second-hit")
#: the ghost list's default size (chunk keys remembered by ``second-hit``): about 20 MiB of index
ADMIT_GHOSTS = 262144
#: the most keys the ghost list may remember
ADMIT_GHOSTS_MAX = 1 << 26
#: how eviction chooses what leaves a full tier (store/ops/eviction.py)
EVICTION_POLICIES = ("segment", "lru")


@dataclass
class RemoteConfig:
    """The shared remote tier (store/tiers/remote.py): a Redis/Valkey server or Redis Cluster.

    ``write``: ``always`` puts every chunk this store stores to the remote tier too (on the
    writer's thread, never the engine's), ``evict`` puts the chunks that eviction takes from
    the last local tier, ``never`` only reads from it (``move --to remote`` still puts). A
    chunk found only there is read, verified and, with ``promote``,
    stored locally. Keys are namespaced by ``key_prefix`` (one per deployment).

    ``secret_file``: the deployment secret (a 0600 file; ``lmctl remote secret PATH`` makes
    one): values carry its MAC and names are keyed with it. ``previous_secret_file``: the
    secret it replaces, still read (never written) during a rotation. ``encrypt``: encrypt
    the pieces too (AES-256-GCM). Without a secret the tier starts only with ``trust =
    "all-writers"``: every client that can write to the prefix is trusted."""

    url: str
    key_prefix: str = "lmctl"
    write: str = "always"
    promote: bool = True
    piece_bytes: int = 4 << 20
    lookup_timeout_s: float = 0.05
    io_timeout_s: float = 2.0
    password_file: str | None = None
    secret_file: str | None = None
    previous_secret_file: str | None = None
    encrypt: bool = False
    trust: str | None = None

    def validate(self) -> None:
        if not any(self.url.startswith(s) for s in ("redis://", "rediss://", "unix://")):
            raise StoreError("the remote tier's url must start with redis://, rediss:// or unix://")
        if not self.key_prefix or any(c in self.key_prefix for c in "{}: \t\n"):
            raise StoreError("the remote tier's key_prefix must be a non-empty name without {, }, : or spaces")
        if self.write not in REMOTE_WRITES:
            raise StoreError(f"the remote tier's write policy must be one of {', '.join(REMOTE_WRITES)}")
        if self.piece_bytes < 64 << 10 or self.lookup_timeout_s <= 0 or self.io_timeout_s <= 0:
            raise StoreError("the remote tier needs piece_bytes >= 64KiB and positive timeouts")
        from .format.remote_auth import check_trust

        check_trust(self.key_prefix, self.secret_file, self.previous_secret_file, self.encrypt, self.trust)


@dataclass
class StoreConfig:
    tiers: dict[str, TierConfig] = field(default_factory=lambda: {"nvme": TierConfig(capacity=64 * GiB)})
    #: tier that new chunks are written to
    default_tier: str = "nvme"
    #: a segment is sealed once it reaches this size; compaction works segment by segment
    segment_bytes: int = 256 * MiB
    #: fdatasync each batch's segment files before the index commit that makes it visible; with
    #: False a power loss may lose recent chunks (never make them wrong). The index commit itself
    #: is synced either way
    fsync: bool = True
    #: codec for new chunks; "raw" keeps compression off the engine's hot path
    codec: str = "raw"
    codec_level: int = 1
    #: eviction brings a full tier down to this fraction of its capacity
    low_watermark: float = 0.9
    #: what leaves a full tier: ``segment`` (whole segments, the coldest and emptiest first, so
    #: that eviction moves almost no live bytes) or ``lru`` (exact LRU chunk by chunk, and
    #: compaction of the dead space it leaves)
    eviction: str = "segment"
    #: how often access times (for LRU) are written to the index, in seconds
    access_flush_s: float = 1.0
    #: sealed segments with at least this fraction of dead bytes are compacted
    compact_dead_ratio: float = 0.3
    #: chunks of a model fingerprint that no engine has used for this long, while the same
    #: model id has been served with another fingerprint since, are evicted first
    retire_after_s: float = 3600.0
    #: raw chunks nobody has read for this long are compressed (zstd-shuffle, level 1) by the
    #: daemon's maintenance, a batch per pass, off the engine's hot path; 0: never
    compress_cold_after_s: float = 0.0
    #: the shared remote tier (None: this store has none)
    remote: RemoteConfig | None = None
    #: the remote tier's settings while it is off (``remote.url=none``): a new ``remote.url``
    #: takes them up again (its key prefix, write policy, secret, ...), not the defaults
    remote_off: RemoteConfig | None = None
    #: events the store's event log keeps (evictions, corrupt drops, dropped saves, pins); the
    #: oldest go first. Their counters are kept apart and never dropped
    event_log_max: int = 10000
    #: which computed chunks are written to the nvme tier (``ADMIT_MODES``): ``second-hit``
    #: keeps a chunk off it until its key is seen a second time (a bounded ghost list of keys in
    #: the index), and a chunk that leaves the dram tier unread and unseen again is dropped, not
    #: spilled. Pinned chunks are always admitted
    admit: str = "all"
    #: how many chunk keys the ghost list remembers (the oldest are forgotten first)
    admit_ghosts: int = ADMIT_GHOSTS

    def validate(self) -> None:
        if not self.tiers:
            raise StoreError("a store needs at least one tier")
        for name, t in self.tiers.items():
            if name not in TIER_ORDER:
                raise StoreError(f"unknown local tier {name!r}; local tiers are {', '.join(TIER_ORDER)}")
            if t.capacity <= 0:
                raise StoreError(f"tier {name} needs a positive capacity in bytes")
            if t.pin_budget < 0:
                raise StoreError(f"tier {name}: pin budget must not be negative")
            if t.write_budget is not None:
                if name != "nvme":
                    raise StoreError(f"tier {name} takes no write budget: only the nvme tier wears out "
                                     "(tiers.nvme.write_budget)")
                parse_write_budget(t.write_budget, t.capacity)
        if self.default_tier not in self.tiers:
            raise StoreError(f"default tier {self.default_tier!r} is not configured")
        if self.segment_bytes < 64 * 1024:
            raise StoreError("segment_bytes must be at least 64 KiB")
        if not 0 < self.low_watermark <= 1:
            raise StoreError("low_watermark must be in (0, 1]")
        if self.eviction not in EVICTION_POLICIES:
            raise StoreError(f"eviction must be one of {', '.join(EVICTION_POLICIES)}, not {self.eviction!r}")
        if self.retire_after_s < 0:
            raise StoreError("retire_after_s must not be negative")
        if self.compress_cold_after_s < 0:
            raise StoreError("compress_cold_after_s must not be negative (0 turns it off)")
        if isinstance(self.event_log_max, bool) or not isinstance(self.event_log_max, int) or \
                not 1 <= self.event_log_max <= EVENT_LOG_MAX:
            raise StoreError(f"event_log_max must be a whole number of events, 1 to {EVENT_LOG_MAX}")
        if self.admit not in ADMIT_MODES:
            raise StoreError(f"admit must be one of {', '.join(ADMIT_MODES)}, not {str(self.admit)[:40]!r}")
        if isinstance(self.admit_ghosts, bool) or not isinstance(self.admit_ghosts, int) or \
                not 1 <= self.admit_ghosts <= ADMIT_GHOSTS_MAX:
            raise StoreError(f"admit_ghosts must be a whole number of chunk keys, 1 to {ADMIT_GHOSTS_MAX}")
        if self.remote is not None:
            self.remote.validate()
        from .format.codec import codec_id

        codec_id(self.codec)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> StoreConfig:
        doc = json.loads(text)
        tier_known = set(TierConfig.__dataclass_fields__)
        doc["tiers"] = {k: TierConfig(**{f: x for f, x in v.items() if f in tier_known})
                        for k, v in doc["tiers"].items()}
        for name in ("remote", "remote_off"):
            if isinstance(doc.get(name), dict):
                doc[name] = RemoteConfig(**doc[name])
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in doc.items() if k in known})


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2, "mib": 1 << 20,
          "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
          "p": 1 << 50, "pb": 1000**5, "pib": 1 << 50, "e": 1 << 60, "eb": 1000**6, "eib": 1 << 60}
#: the largest size: what a signed 64-bit byte count holds (the index keeps sizes so)
MAX_SIZE = 2**63 - 1


def human_size(n: float) -> str:
    """A byte count for people: 512 B, 1.5 MiB, 64.0 GiB (``lmctl.terminal.human`` too)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


#: the smallest tier capacity an operator may set: below it a tier holds a handful of chunks
MIN_CAPACITY = 16 << 20


def parse_unit_size(value: object, name: str) -> int:
    """A size from operator input (command line, config file, connector settings): a unit is
    required (``500GiB``, ``4096B``), so a bare number can never mean a few bytes by mistake."""
    if (isinstance(value, (int, float)) and not isinstance(value, bool)) or (
            isinstance(value, str) and re.fullmatch(r"\s*[\d.eE+-]+\s*", value)):
        raise StoreError(f"{name} {value!r} has no unit: write it as a size like 500GiB or 1TB "
                         f"(or {value}B if you really mean bytes)")
    if not isinstance(value, str):
        raise StoreError(f"{name} must be a size like 500GiB, not {value!r}")
    return parse_size(value)


def parse_capacity(value: object, name: str = "capacity") -> int:
    """A tier capacity from operator input: a size with a unit, at least 16 MiB (a bare ``10``
    would otherwise evict the whole cache)."""
    n = parse_unit_size(value, name)
    if n < MIN_CAPACITY:
        raise StoreError(f"{name} {value!r} is too small: a tier needs at least 16MiB")
    return n


def parse_size(value: int | float | str) -> int:
    """Bytes from ``123``, ``"64GiB"``, ``"1.5 TB"`` or ``"512m"`` (binary for bare letters)."""
    if isinstance(value, bool):
        raise StoreError(f"size {value!r} is not a number of bytes")
    if isinstance(value, (int, float)):
        if value < 0 or value != value or value in (float("inf"), float("-inf")):
            raise StoreError(f"size {value!r} must be a finite, non-negative number of bytes")
        return int(value)
    text = str(value).strip().lower().replace(" ", "").replace("_", "")
    num = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(num):]
    try:
        n = float(num)
    except ValueError:
        raise StoreError(f"size {value!r} is not a size like 512MiB, 64GiB or 1TB") from None
    if unit not in _UNITS or not 0 <= n * _UNITS[unit]:  # NaN fails too
        raise StoreError(f"size {value!r} is not a size like 512MiB, 64GiB or 1TB")
    if n * _UNITS[unit] > MAX_SIZE:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise StoreError(f"size {shown} is too large: the largest size is 2^63 - 1 bytes (just under 8EiB)")
    return int(n * _UNITS[unit])


#: a write budget: drive writes per day, or a size per day
_BUDGET_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*dwpd\s*", re.I)
_PER_DAY_RE = re.compile(r"(.+?)\s*/\s*(?:day|d)\s*", re.I)


def parse_write_budget(value: object, capacity: int) -> int | None:
    """Bytes per day from a write budget: ``1DWPD`` / ``0.5 DWPD`` (drive writes per day of a
    tier of ``capacity`` bytes), or a size per day (``500GiB/day``, ``2TB/d``); None for
    none (None, ``""``, ``"none"``). ``StoreError`` saying how to write it otherwise."""
    if value is None:
        return None
    hint = "write it as drive writes per day of the nvme tier's capacity (1DWPD, 0.3DWPD) or a size per day " \
           "(500GiB/day), or none"
    if not isinstance(value, str):
        raise StoreError(f"write budget {str(value)[:40]!r} is not a budget: {hint}")
    text = value.strip()
    if text.lower() in ("", "none"):
        return None
    m = _BUDGET_RE.fullmatch(text)
    if m:
        dwpd = float(m.group(1))
        if not 0 < dwpd <= 1000:
            raise StoreError(f"write budget {text[:40]!r}: give more than 0 and at most 1000 drive writes per day")
        return max(1, int(dwpd * capacity))
    m = _PER_DAY_RE.fullmatch(text)
    if m and re.search(r"[a-zA-Z]", m.group(1)):
        try:
            n = parse_size(m.group(1))
        except StoreError:
            raise StoreError(f"write budget {text[:40]!r} is not a budget: {hint}") from None
        if n <= 0:
            raise StoreError(f"write budget {text[:40]!r} must be more than nothing per day")
        return n
    raise StoreError(f"write budget {text[:40]!r} is not a budget: {hint}")
