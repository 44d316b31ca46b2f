"""lmctl's KV chunk store: an LMDB index over append-only segment files.

The public API is re-exported here; see docs/architecture.md.
"""

from .config import GiB, MiB, StoreConfig, TierConfig
from .errors import CorruptEntry, DiskFullError, IndexWriteError, PinBudgetError, ReadOnlyError, StoreError
from .format.keys import (
    DEFAULT_CHUNK_SIZE,
    AdapterIdentity,
    KVFormat,
    Namespace,
    NamespaceRecord,
    adapter_digest,
    boundary_keys,
    chain_hash,
    chunk_keys,
    parse_key,
    record_key,
    short_key,
)
from .shared import open_shared, release_shared
from .store import Store
from .types import (
    Chunk,
    ChunkInfo,
    Compacted,
    Counts,
    Evicted,
    Explanation,
    LookupResult,
    MaintenanceResult,
    PartialHit,
    Problem,
    PutItem,
    RewriteResult,
    StoreCounts,
    StoreStats,
    TierStats,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE", "AdapterIdentity", "Chunk", "ChunkInfo", "Compacted", "CorruptEntry", "Counts",
    "DiskFullError", "Evicted", "Explanation", "GiB", "IndexWriteError", "KVFormat", "LookupResult",
    "MaintenanceResult", "MiB", "PartialHit", "Namespace", "NamespaceRecord", "PinBudgetError", "Problem", "PutItem",
    "ReadOnlyError", "RewriteResult", "Store", "StoreConfig", "StoreCounts", "StoreError", "StoreStats",
    "TierConfig", "TierStats",
    "adapter_digest", "boundary_keys", "chain_hash", "chunk_keys", "open_shared", "parse_key", "record_key",
    "release_shared", "short_key",
]
