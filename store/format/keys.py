"""Chunk identity: namespaces, adapter identities and prefix-chained chunk hashes.

Everything here is pure Python (hashlib, json, array) so that the CLI can compute
keys without importing numpy, torch or vllm.

Scheme (see docs/architecture.md):

* ``canonical(ns)``   = compact, key-sorted JSON of every field of the namespace
* ``ns_id``           = sha256(b"lmctl/ns/v1\\0" + canonical)[:16]
* ``h0``              = sha256(b"lmctl/chain/v1\\0" + canonical)
* ``h_i``             = sha256(h_{i-1} + tokens of chunk i as little-endian uint32)
* chunk key           = ns_id (16 bytes) + h_i (32 bytes)
* partial key         = ns_id + sha256(h_{i-1} + the first t tokens of chunk i), t a multiple
  of the engine's block: the key of a request's partial last chunk (a "tail" record of t
  tokens) and of an alias to the first t tokens of a full chunk's record (``boundary_keys``)

The namespace id prefixes the key so that one namespace (model + format + adapter +
salt) is one contiguous range of the index.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import StoreError

DEFAULT_CHUNK_SIZE = 256
#: the block (tokens) a lookup tries partial hits at when its caller names none: vLLM's
#: block on GPUs; every larger block in use (32, 64, 128 on CPUs) is a multiple of it
PARTIAL_BLOCK = 16
LAYOUT_VERSION = 1
NS_ID_BYTES = 16
HASH_BYTES = 32
KEY_BYTES = NS_ID_BYTES + HASH_BYTES
PREFIX_ID_BYTES = 16

#: Element size in bytes of every dtype the store knows by name.
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "uint8": 1,
    "int8": 1,
}

# Files that define an adapter's behaviour. Anything else in the folder (README,
# training logs) does not change the KV it produces and is left out of the digest.
_ADAPTER_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".json")
_ADAPTER_SKIP_FILES = {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"}


@dataclass(frozen=True)
class KVFormat:
    """Shape and encoding of the KV that one chunk holds (for one tensor-parallel rank)."""

    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tp_size: int = 1
    tp_rank: int = 0
    chunk_size: int = DEFAULT_CHUNK_SIZE
    layout_version: int = LAYOUT_VERSION
    #: 2: a K and a V plane of ``head_dim`` each; 1: one latent plane per token (MLA, where
    #: ``head_dim`` is the latent's width and ``num_kv_heads`` is 1)
    kv_planes: int = 2

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_SIZES:
            raise StoreError(f"unknown KV dtype {self.dtype!r}; known: {', '.join(DTYPE_SIZES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "tp_size", "chunk_size"):
            if getattr(self, name) <= 0:
                raise StoreError(f"KV format field {name} must be positive")
        if not 0 <= self.tp_rank < self.tp_size:
            raise StoreError(f"tp_rank {self.tp_rank} is outside tp_size {self.tp_size}")
        if type(self.kv_planes) is not int or self.kv_planes not in (1, 2):
            raise StoreError(f"KV format field kv_planes must be 1 (a latent, MLA) or 2 (K and V), "
                             f"not {self.kv_planes!r}")

    def doc(self) -> dict[str, Any]:
        """The fields that identify this format: every field, but ``kv_planes`` only where it
        is not the K-and-V default, so formats recorded before it existed keep their ids."""
        d = asdict(self)
        if self.kv_planes == 2:
            del d["kv_planes"]
        return d

    @property
    def chunk_bytes(self) -> int:
        """Raw bytes of one full chunk: layers x planes (K, V) x tokens x heads x head_dim."""
        return (
            self.num_layers * self.kv_planes * self.chunk_size * self.num_kv_heads * self.head_dim
            * DTYPE_SIZES[self.dtype]
        )

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        """Canonical payload shape: [layers, planes (K, V; or one latent), tokens, kv_heads, head_dim]."""
        return (self.num_layers, self.kv_planes, self.chunk_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class AdapterIdentity:
    """A LoRA adapter: its name plus a digest of the files that define its weights."""

    name: str
    digest: str

    def __str__(self) -> str:
        return f"{self.name}@{self.digest}"

    @classmethod
    def parse(cls, text: str) -> AdapterIdentity:
        name, sep, digest = text.partition("@")
        if not sep or not name or not digest:
            raise StoreError(f"adapter identity {text!r} is not of the form NAME@DIGEST")
        return cls(name, digest)

    @classmethod
    def from_path(cls, name: str, folder: str | os.PathLike[str]) -> AdapterIdentity:
        return cls(name, adapter_digest(folder))


def adapter_digest(folder: str | os.PathLike[str]) -> str:
    """Digest (128 bits, hex) of an adapter folder's weight and config files.

    The digest covers each file's path relative to the folder and its bytes, in
    sorted order, so the same adapter copied elsewhere has the same digest, and any
    change to its weights or config gives a new one.
    """
    root = Path(folder)
    if not root.is_dir():
        raise StoreError(f"adapter folder {str(root)!r} does not exist or is not a folder")
    files = sorted(
        p for p in root.rglob("*")
        if p.is_file() and p.suffix in _ADAPTER_FILE_SUFFIXES and p.name not in _ADAPTER_SKIP_FILES
    )
    if not files:
        raise StoreError(f"adapter folder {str(root)!r} has no weight or config files")
    h = hashlib.sha256(b"lmctl/adapter/v1\0")
    for p in files:
        rel = p.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "little") + rel)
        h.update(p.stat().st_size.to_bytes(8, "little"))
        with open(p, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    return h.hexdigest()[:32]


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for two chunks of equal tokens to be interchangeable."""

    model: str
    kv_format: KVFormat
    adapter: AdapterIdentity | None = None
    cache_salt: str | None = None
    model_fingerprint: str | None = None
    _canonical: bytes = field(default=b"", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.model:
            raise StoreError("namespace needs a model id")
        doc = {
            "model": self.model,
            "kv_format": self.kv_format.doc(),
            "adapter": None if self.adapter is None else asdict(self.adapter),
            "cache_salt": self.cache_salt,
            "model_fingerprint": self.model_fingerprint,
        }
        canon = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        object.__setattr__(self, "_canonical", canon)

    @property
    def canonical(self) -> bytes:
        return self._canonical

    @property
    def ns_id(self) -> bytes:
        return hashlib.sha256(b"lmctl/ns/v1\0" + self._canonical).digest()[:NS_ID_BYTES]

    @property
    def root_hash(self) -> bytes:
        return hashlib.sha256(b"lmctl/chain/v1\0" + self._canonical).digest()

    def to_json(self) -> str:
        return self._canonical.decode()

    @classmethod
    def from_json(cls, text: str | bytes) -> Namespace:
        doc = json.loads(text)
        adapter = doc.get("adapter")
        return cls(
            model=doc["model"],
            kv_format=KVFormat(**doc["kv_format"]),
            adapter=None if adapter is None else AdapterIdentity(**adapter),
            cache_salt=doc.get("cache_salt"),
            model_fingerprint=doc.get("model_fingerprint"),
        )

    def chunk_keys(self, tokens: Sequence[int] | Iterable[int]) -> list[bytes]:
        """Keys of every *full* chunk of ``tokens``, in order (a trailing partial chunk has none)."""
        return chunk_keys(self, tokens)

    def record(self, salt_digest: str | None) -> dict[str, Any]:
        """The namespace as the index records it: every field but the salt, which only its
        keyed digest stands for (see ``Store.salt_digest``)."""
        doc = json.loads(self._canonical)
        del doc["cache_salt"]
        doc["salt_digest"] = salt_digest
        return doc  # type: ignore[no-any-return]


@dataclass(frozen=True)
class NamespaceRecord:
    """A namespace as the index recorded it. Without the salt it cannot compute keys: give
    the salt to ``namespace()`` to get the ``Namespace`` back."""

    ns_id: bytes
    model: str
    kv_format: KVFormat
    adapter: AdapterIdentity | None = None
    model_fingerprint: str | None = None
    salted: bool = False
    salt_digest: str | None = None

    @classmethod
    def from_record(cls, ns_id: bytes, doc: dict[str, Any]) -> NamespaceRecord:
        """Parse the ``namespace`` object of an index record (older records held the salt
        itself under ``cache_salt``: such a record is salted, with no digest)."""
        adapter = doc.get("adapter")
        digest = doc.get("salt_digest")
        return cls(
            ns_id=bytes(ns_id),
            model=doc["model"],
            kv_format=KVFormat(**doc["kv_format"]),
            adapter=None if adapter is None else AdapterIdentity(**adapter),
            model_fingerprint=doc.get("model_fingerprint"),
            salted=digest is not None or doc.get("cache_salt") is not None,
            salt_digest=digest,
        )

    def namespace(self, cache_salt: str | None = None) -> Namespace:
        """This record's namespace with ``cache_salt``; its ``ns_id`` equals this record's
        only when the salt is the one the record was made with."""
        return Namespace(self.model, self.kv_format, self.adapter, cache_salt, self.model_fingerprint)


def _token_bytes(tokens: Sequence[int]) -> bytes:
    try:
        arr = array("I", tokens)
    except (OverflowError, TypeError) as exc:
        raise StoreError(f"token ids must be integers in [0, 2**32): {exc}") from None
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def chunk_keys(ns: Namespace, tokens: Sequence[int] | Iterable[int]) -> list[bytes]:
    toks = tokens if isinstance(tokens, Sequence) else list(tokens)
    size = ns.kv_format.chunk_size
    full = len(toks) // size
    if full == 0:
        return []
    raw = _token_bytes(toks[: full * size])
    step = size * 4
    prefix = ns.ns_id
    h = ns.root_hash
    keys = []
    for i in range(full):
        h = hashlib.sha256(h + raw[i * step : (i + 1) * step]).digest()
        keys.append(prefix + h)
    return keys


def chain_hash(ns: Namespace, keys: Sequence[bytes], chunk: int) -> bytes:
    """The chain hash before chunk ``chunk`` (``h_{chunk-1}``; ``h0`` for the first), from the
    keys of the chunks before it (a key is ``ns_id`` + its chain hash)."""
    return ns.root_hash if chunk == 0 else bytes(keys[chunk - 1][NS_ID_BYTES:])


def boundary_keys(ns: Namespace, prev: bytes, tokens: Sequence[int], block: int) -> list[tuple[int, bytes]]:
    """The key at every ``block`` boundary inside one chunk's ``tokens`` (at most a chunk of
    them), as ``(tokens through the boundary, key)`` in token order: the prefix-chained hash
    through that block, ``sha256(prev || tokens[:t])``. ``prev`` is the chain hash before the
    chunk (``chain_hash``). At ``t`` = the chunk size it is the chunk's own key; below it, the
    key of a partial chunk (a request's tail) or an alias of a full chunk's leading blocks."""
    if block <= 0:
        raise StoreError(f"block size must be positive, not {block}")
    n = min(len(tokens), ns.kv_format.chunk_size) // block
    if n == 0:
        return []
    raw = _token_bytes(tokens[: n * block])
    step = block * 4
    h = hashlib.sha256(prev)
    out = []
    for i in range(n):
        h.update(raw[i * step : (i + 1) * step])
        out.append(((i + 1) * block, ns.ns_id + h.copy().digest()))
    return out


def record_key(ns: Namespace, keys: Sequence[bytes], tokens: Sequence[int], chunk: int, block: int,
               n: int | None = None) -> tuple[bytes, list[tuple[bytes, int]]]:
    r"""The key of a record of chunk ``chunk``'s first ``n`` tokens (default: the whole chunk;
    fewer: a request's tail, whole ``block``\ s), and its aliases: the partial keys at the block
    boundaries inside it with their token counts (``PutItem.aliases``). ``keys``: the full
    chunks' keys of ``tokens`` (``chunk_keys``), of which the chunks before ``chunk`` count."""
    cs = ns.kv_format.chunk_size
    n = cs if n is None else n
    if not 0 < n <= cs or n % block or (n < cs and cs % block) or len(tokens) < chunk * cs + n:
        raise StoreError(f"a record of chunk {chunk} holds whole blocks of {block} tokens, up to a chunk of {cs}, "
                         f"of the {len(tokens)} given; not {n}")
    inner = boundary_keys(ns, chain_hash(ns, keys, chunk), tokens[chunk * cs : chunk * cs + n], block)
    if n == cs and n % block:  # a chunk that is not whole blocks: its own key, no aliases
        return chunk_keys(ns, tokens[: (chunk + 1) * cs])[-1], []
    return inner[-1][1], [(k, t) for t, k in inner[:-1]]


def prefix_ids(tokens: Sequence[int], chunk_size: int, secret: bytes, limit: int | None = None) -> list[bytes]:
    """The namespace-free id of the token prefix that ends each full chunk of ``tokens``:
    ``HMAC-SHA256(secret, "lmctl/prefix/v1\\0" || tokens[:end] as little-endian uint32)[:16]``
    at every chunk end (``limit``: of the first ``limit`` chunks only).

    It does not depend on the namespace or on the chunk size (the same tokens give the same
    id at the same end whatever the chunking), so the store can tell which namespaces hold a
    prefix. ``secret`` is the store's salt key: ids of one store mean nothing elsewhere, and
    no one without the index can test a guessed text against them."""
    full = len(tokens) // chunk_size
    if limit is not None:
        full = min(full, limit)
    if full <= 0:
        return []
    raw = _token_bytes(tokens[: full * chunk_size])
    step = chunk_size * 4
    mac = hmac.new(secret, b"lmctl/prefix/v1\0", hashlib.sha256)
    out = []
    for i in range(full):
        mac.update(raw[i * step : (i + 1) * step])
        out.append(mac.copy().digest()[:PREFIX_ID_BYTES])
    return out


def short_key(key: bytes) -> str:
    """What tells two chunks apart in a message: the start of the chunk hash (a key's first
    16 bytes are its namespace, the same for every chunk of a model and adapter)."""
    return key[16:24].hex() if len(key) > 16 else key.hex()


def key_hex(key: bytes) -> str:
    return key.hex()


def parse_key(text: str) -> bytes:
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise StoreError(f"chunk key {text!r} is not hex") from None
    if len(key) != KEY_BYTES:
        raise StoreError(f"chunk key must be {KEY_BYTES * 2} hex digits, got {len(text)}")
    return key
