"""What the store takes and gives back: plain dataclasses, no behaviour of their own."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from typing_extensions import Buffer


@dataclass(frozen=True)
class Origin:
    """Where a stored chunk came from when this store's own engines did not compute it: the
    ``tier`` it was promoted from (``remote``), ``at`` what time it arrived (the entry's
    creation) and the ``writer`` id its authenticated head names (0: none; ``lmctl status``
    shows each store's own)."""

    tier: str = "remote"
    writer: int = 0
    at: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "at": self.at, "writer": f"{self.writer:08x}" if self.writer else None}


@dataclass
class PutItem:
    """One chunk to store: its key, payload, layout (dtype, shape), token count, codec
    (None: the store's default), the id of the token prefix it ends (``Store.prefix_ids``;
    None: unknown), which lets ``Store.explain`` find it from another namespace, and its
    ``origin`` when it was not computed here (a chunk promoted from the remote tier)."""

    key: bytes
    data: Buffer
    layout: dict[str, Any]
    tokens: int = 0
    codec: str | None = None
    prefix: bytes | None = None
    origin: Origin | None = None
    #: other keys that find the leading tokens of this record: (partial key, tokens), made by
    #: ``keys.boundary_keys`` at the engine's block boundaries inside the chunk
    aliases: list[tuple[bytes, int]] | None = None


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
    origin: Origin | None = None


@dataclass
class PartialHit:
    """The leading ``tokens`` of chunk ``chunk`` (the first chunk not stored whole), found at
    a block boundary inside it: in the record of ``key``, which holds ``record_tokens``
    tokens, in ``tier``. ``alias``: the partial key that named a full chunk's record (None:
    ``key`` is itself the partial key, a request's tail record of exactly ``tokens``)."""

    chunk: int
    key: bytes
    tokens: int
    record_tokens: int
    tier: str
    alias: bytes | None = None


@dataclass
class LookupResult:
    """The longest stored prefix of a token sequence: ``hit_tokens`` of ``total_tokens``,
    with every chunk's key and the tier that holds it (None where it is not stored), and the
    leading blocks of the next chunk where a partial record or an alias holds them."""

    total_tokens: int
    chunk_size: int
    keys: list[bytes]
    tiers: list[str | None]
    partial: PartialHit | None = None

    def set_tiers(self, tiers: list[str | None]) -> None:
        """New tiers (the remote tier's answer): a partial hit stands only where it still
        follows the stored chunks."""
        self.tiers = tiers
        if self.partial is not None and self.partial.chunk != self.hit_chunks:
            self.partial = None

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
        n = self.hit_chunks
        extra = self.partial.tokens if self.partial is not None and self.partial.chunk == n else 0
        return n * self.chunk_size + extra


@dataclass
class Problem:
    """One inconsistency found by ``Store.check`` (``key``: the chunk it is about, if one)."""

    kind: str
    detail: str
    fixed: bool = False
    key: bytes | None = None


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
    pinned_chunks: int = 0


@dataclass
class Counts:
    """Chunks and their bytes (stored, and on disk with padding and trailer), and how many of
    them are pinned: what the index keeps counted per namespace, label and tier."""

    chunks: int = 0
    bytes: int = 0
    disk_bytes: int = 0
    pinned_chunks: int = 0
    pinned_bytes: int = 0
    pinned_disk_bytes: int = 0

    def add(self, other: Counts) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def unpinned(self) -> Counts:
        """The chunks of these that are not pinned."""
        return Counts(self.chunks - self.pinned_chunks, self.bytes - self.pinned_bytes,
                      self.disk_bytes - self.pinned_disk_bytes)

    def pinned(self) -> Counts:
        """The chunks of these that are pinned."""
        return Counts(self.pinned_chunks, self.pinned_bytes, self.pinned_disk_bytes, self.pinned_chunks,
                      self.pinned_bytes, self.pinned_disk_bytes)

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class StoreCounts:
    """The counts the index keeps (``Store.counts``): per namespace id and tier, and per label
    the keys it pins (stored or not) and its stored chunks per namespace id and tier."""

    namespaces: dict[bytes, dict[str, Counts]] = field(default_factory=dict)
    labels: dict[str, dict[bytes, dict[str, Counts]]] = field(default_factory=dict)
    label_keys: dict[str, int] = field(default_factory=dict)

    def total(self, namespaces: Iterable[bytes] | None = None, tier: str | None = None,
              label: str | None = None) -> Counts:
        """The chunks of ``namespaces`` (None: all), in ``tier`` (None: all), pinned by
        ``label`` (None: pinned or not)."""
        src = self.namespaces if label is None else self.labels.get(label, {})
        wanted = None if namespaces is None else set(namespaces)
        out = Counts()
        for nid, tiers in src.items():
            if wanted is not None and nid not in wanted:
                continue
            for tname, c in tiers.items():
                if tier is None or tname == tier:
                    out.add(c)
        return out


@dataclass
class StoreStats:
    """Usage per tier, the store's counters (kept in the index, so they cover every process
    that uses the store) and the write amplification (bytes written per payload byte)."""

    tiers: dict[str, TierStats]
    counters: dict[str, int] = field(default_factory=dict)
    write_amplification: float = 0.0
    #: the remote tier: its redacted url, settings and this process's counters (None: none)
    remote: dict[str, Any] | None = None
    #: why the configured remote tier did not start (None: it did, or there is none)
    remote_refused: str | None = None

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
