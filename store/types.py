"""What the store takes and gives back: plain dataclasses, no behaviour of their own."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from typing_extensions import Buffer


@dataclass
class PutItem:
    """One chunk to store: its key, payload, layout (dtype, shape), token count, codec
    (None: the store's default) and the id of the token prefix it ends (``Store.prefix_ids``;
    None: unknown), which lets ``Store.explain`` find it from another namespace."""

    key: bytes
    data: Buffer
    layout: dict[str, Any]
    tokens: int = 0
    codec: str | None = None
    prefix: bytes | None = None


@dataclass
class Chunk:
    """A chunk read from the store. ``data`` is the decoded payload."""

    key: bytes
    data: Buffer
    layout: dict[str, Any]
    tokens: int
    tier: str
    codec: str


@dataclass
class ChunkInfo:
    """Index metadata of one chunk (no payload)."""

    key: bytes
    tier: str
    codec: str
    stored_bytes: int
    raw_bytes: int
    disk_bytes: int
    tokens: int
    hits: int
    created: float
    last_access: float
    pin_refs: int
    layout: dict[str, Any]
    segment: int
    offset: int
    level: int = 0


@dataclass
class LookupResult:
    """The longest stored prefix of a token sequence: ``hit_tokens`` of ``total_tokens``,
    with every chunk's key and the tier that holds it (None where it is not stored)."""

    total_tokens: int
    chunk_size: int
    keys: list[bytes]
    tiers: list[str | None]

    @property
    def hit_chunks(self) -> int:
        """The leading chunks that are stored (up to the first miss)."""
        n = 0
        for tier in self.tiers:
            if tier is None:
                break
            n += 1
        return n

    @property
    def hit_tokens(self) -> int:
        return self.hit_chunks * self.chunk_size


@dataclass
class Problem:
    """One inconsistency found by ``Store.check``."""

    kind: str
    detail: str
    fixed: bool = False


class Evicted(NamedTuple):
    """What ``Store.evict`` removed."""

    chunks: int
    bytes: int


class Compacted(NamedTuple):
    """What ``Store.compact`` did: segments removed and their bytes reclaimed."""

    segments: int
    bytes: int


@dataclass
class RewriteResult:
    """What ``Store.rewrite`` did: chunks rewritten, their stored bytes before and after
    (estimated from samples on a dry run), chunks already as asked, chunks not stored."""

    chunks: int = 0
    bytes_before: int = 0
    bytes_after: int = 0
    skipped: int = 0
    missing: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class MaintenanceResult:
    """What one ``Store.maintain`` pass did."""

    evicted: int = 0
    segments_compacted: int = 0
    bytes_reclaimed: int = 0
    segments_forgotten: int = 0
    chunks_compressed: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class TierStats:
    """One tier's usage: chunks and their bytes, the bytes its segment files take on disk
    (dead records included), pinned bytes and the settings that bound them."""

    chunks: int
    bytes: int
    disk_bytes: int
    dead_bytes: int
    segments: int
    capacity: int
    pinned_bytes: int
    pin_budget: int
    direct_io: bool
    path: str


@dataclass
class StoreStats:
    """Usage per tier, the store's counters (kept in the index, so they cover every process
    that uses the store) and the write amplification (bytes written per payload byte)."""

    tiers: dict[str, TierStats]
    counters: dict[str, int] = field(default_factory=dict)
    write_amplification: float = 0.0
    #: the remote tier: its redacted url, settings and this process's counters (None: none)
    remote: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Explanation:
    """Why the first missing chunk of a lookup misses (``Store.explain``): the chunk's index,
    first token and key, a reason code and a sentence for people, and the facts behind it
    (``event``: the logged event; ``holder``: another namespace that holds the prefix)."""

    chunk: int
    token: int
    key: bytes
    reason: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"chunk": self.chunk, "token": self.token, "key": self.key.hex(), "reason": self.reason,
                "message": self.message, **self.details}
