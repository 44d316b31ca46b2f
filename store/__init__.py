"""lmctl's KV chunk store: an LMDB index over append-only segment files.

The public API is re-exported here; see docs/architecture.md.
"""

from .config import GiB, MiB, StoreConfig, TierConfig
from .errors import CapacityError, DiskFullError, PinBudgetError, StoreError
from .keys import (
    DEFAULT_CHUNK_SIZE,
    AdapterIdentity,
    KVFormat,
    Namespace,
    NamespaceRecord,
    adapter_digest,
    chunk_keys,
    parse_key,
)
from .shared import open_shared, release_shared
from .store import Chunk, ChunkInfo, LookupResult, LRUPolicy, Problem, PutItem, Store

__all__ = [
    "DEFAULT_CHUNK_SIZE", "AdapterIdentity", "CapacityError", "DiskFullError", "Chunk", "ChunkInfo", "GiB",
    "KVFormat", "LRUPolicy", "LookupResult", "MiB", "Namespace", "NamespaceRecord", "PinBudgetError", "Problem",
    "PutItem", "Store", "StoreConfig", "StoreError", "TierConfig", "adapter_digest",
    "chunk_keys", "open_shared", "parse_key", "release_shared",
]
